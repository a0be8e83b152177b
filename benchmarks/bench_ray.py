"""Scale-out on Ray: annotate throughput with 1/2/3 workers, lease requests per shard on S3, Ray vs local launcher.

    python benchmarks/bench_ray.py --shards 96                # docs/benchmarks.md: (a), (b), and (c) at 4 steps
    python benchmarks/bench_ray.py --only-launchers --steps 40  # docs/benchmarks.md: (c) on a longer run
    python benchmarks/bench_ray.py --only-launchers --demo --steps 200  # (c) on the demo's config
    python benchmarks/bench_ray.py --only-launchers --rounds 3  # (c) alternating local / ray / local / ray …
    python benchmarks/bench_ray.py --only-launchers --rounds 2 --attached  # and ray joining a running Ray
    python benchmarks/bench_ray.py --quick                    # a smoke run

(a) Annotate throughput under Ray: N annotate actors (`opd annotate --follow`, leases) on one store of rollout
    shards, from the first part to the last (model loading excluded): response tokens per second, and the
    ratio to one worker. The shards are written only once every worker has loaded its teacher and polls (Ray
    starts actors one after another). Shipped tiny teacher (data/models/teacher), CPU; one thread per worker.
(b) Lease requests per shard: one `Annotator` on an S3 store (a moto server on 127.0.0.1), the lease requests
    it made (LIST per poll, create, read-back, renew, check, delete) divided by the shards it annotated.
(c) `opd run` wall time on the tiny config (4 steps), local launcher vs `--launcher ray` (its own one-machine
    Ray, started and stopped inside the run): ratio ray / local, target <= 1.1. With --rounds R the launchers
    alternate (the first of each round alternates too) and the ratio is the median round's; with it come the
    fixed costs of Ray as the launcher pays them: `ray.init` as the launcher calls it, an actor's first command
    (create the actor, start its worker process, run `python -c pass`), and `ray.shutdown`.

Results: tables on stdout and benchmarks/results/bench_ray.json (bench_ray_launchers_<steps>.json for
--only-launchers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from opd_cache.annotate import Annotator  # noqa: E402
from opd_cache.config import AnnotateConfig, Config  # noqa: E402
from opd_cache.observe.metrics import read_metrics  # noqa: E402
from opd_cache.storage.store import Store  # noqa: E402
from opd_cache.testing import write_synthetic_store  # noqa: E402
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint  # noqa: E402

TEACHER = REPO / "data/models/teacher"
STUDENT = REPO / "data/models/student"


def make_store(uri: str, shards: int, rows: int, s3_endpoint: str | None = None) -> Store:
    store = Store(uri, s3_endpoint=s3_endpoint)
    tokenizer = load_tokenizer(str(STUDENT))
    run = store.manifest.ensure(
        student=str(STUDENT), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
    )
    write_synthetic_store(
        store, run, shards, num_rows=rows, top_k=8, prompt_len=(8, 16), response_len=(16, 32), annotate=False
    )
    return store


# ---------------------------------------------------------------- (a) annotate workers under Ray
def annotate_under_ray(root: Path, workers: int, shards: int, rows: int) -> dict:
    import ray

    from opd_cache.launch.ray_actor import StageWorker

    store = make_store(str(root / f"store-{workers}"), 0, rows)  # run.json only: the shards come once all are up
    config = root / f"config-{workers}.yaml"
    config.write_text(yaml.safe_dump({"store": {"uri": store.uri}, "annotate": {"teacher": str(TEACHER), "top_k": 8}}))
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    actor_cls = ray.remote(StageWorker)
    actors, refs = [], []
    for i in range(workers):
        argv = [sys.executable, "-m", "opd_cache.cli", "annotate", "--config", str(config)]
        argv += ["--set", f"annotate.worker_id=a{i}", "--set", "annotate.poll_seconds=0.2", "--follow"]
        actor = actor_cls.options(num_cpus=1).remote(
            f"a{i}", argv, str(root / f"a{workers}-{i}.log"), str(config), "", env
        )
        actors.append(actor)
        refs.append(actor.run.remote())
    # every worker loaded its teacher and polls (its first progress line): only then the shards, all at once
    logs = [root / f"a{workers}-{i}.log" for i in range(workers)]
    while not all(log.exists() and "pending" in log.read_text() for log in logs):
        time.sleep(0.2)
    make_store(store.uri, shards, rows)
    while len(store.shards.annotated_parts()) < shards:
        time.sleep(0.05)
    store.mark_done()
    ray.get(refs)
    records = [
        r
        for name, rs in read_metrics(store).items()
        if name.startswith("annotate-")
        for r in rs
        if r.get("event") == "annotated"
    ]
    first = min(r["time"] - r["seconds"] for r in records)
    last = max(r["time"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    per_worker = {}
    for name, rs in read_metrics(store).items():
        if name.startswith("annotate-"):
            per_worker[name] = sum(1 for r in rs if r.get("event") == "annotated")
    for actor in actors:
        ray.kill(actor)
    return {
        "workers": workers,
        "shards": len(records),
        "duplicates": len(records) - len({r["shard_id"] for r in records}),
        "seconds": last - first,
        "tokens_per_s": tokens / (last - first),
        "shards_per_worker": per_worker,
    }


# ---------------------------------------------------------------- (b) lease requests on S3
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lease_requests_on_s3(shards: int, rows: int) -> dict:
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        Store("s3://bench/run", s3_endpoint=endpoint).fs.create_dir("bench")
        store = make_store("s3://bench/run", shards, rows, s3_endpoint=endpoint)
        cfg = Config(annotate=AnnotateConfig(teacher=str(TEACHER), top_k=8, worker_id="a0"))
        annotator = Annotator(cfg, store, progress=False)
        stats = annotator.run()
        requests = dict(annotator.leases.requests)
    finally:
        server.terminate()
        server.wait()
    total = sum(requests.values())
    return {"shards": len(stats.annotated), "requests": requests, "per_shard": total / max(len(stats.annotated), 1)}


# ---------------------------------------------------------------- (c) launchers
def tiny_run_config(root: Path, steps: int, ray_address: str | None = None) -> Path:
    config = {
        "store": {"uri": str(root / "store")},
        "rollout": {
            "student": str(STUDENT),
            "prompts": str(REPO / "data/arithmetic/train.parquet"),
            "n": 4,
            "batch_prompts": 4,
            "flush_rows": 16,
            "max_buffer_samples": 48,
            "sampling": {"max_new_tokens": 10},
        },
        "annotate": {"teacher": str(TEACHER), "top_k": 8},
        "train": {"max_steps": steps, "global_batch_samples": 16, "lr": 1e-3, "publish_every": 2, "save_every": 2},
        "run": {"evaluate": False},
    }
    if ray_address:
        config["ray"] = {"address": ray_address}
    Config.model_validate(config)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def demo_run_config(root: Path, steps: int) -> Path:
    """examples/arithmetic_cpu/config.yaml (the demo's) with `steps` steps, no evaluator, paths made absolute."""
    config = yaml.safe_load((REPO / "examples/arithmetic_cpu/config.yaml").read_text())
    config["store"]["uri"] = str(root / "store")
    for section, key in (("rollout", "student"), ("rollout", "prompts"), ("annotate", "teacher")):
        config[section][key] = str(REPO / config[section][key])
    config["train"]["max_steps"] = steps
    config.setdefault("run", {})["evaluate"] = False
    Config.model_validate(config)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launcher_wall_time(
    root: Path, launcher: str, steps: int, demo: bool = False, ray_address: str | None = None
) -> float:
    root.mkdir(parents=True)
    config = demo_run_config(root, steps) if demo else tiny_run_config(root, steps, ray_address)
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(config), "--quiet"]
    cmd += ["--launcher", launcher, "--logs", str(root / "logs")]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"opd run --launcher {launcher} failed: {done.stderr[-2000:]}")
    return seconds


def ray_fixed_costs(root: Path) -> dict:
    """The seconds of Ray's own start-up and shutdown in a run: ray.init, one actor to its command, shutdown."""
    import ray

    from opd_cache.launch.ray_actor import StageWorker
    from opd_cache.launch.ray_launcher import bind_ray_to_loopback

    started = time.perf_counter()
    bind_ray_to_loopback()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    init = time.perf_counter() - started
    actor = ray.remote(StageWorker).options(num_cpus=1, max_concurrency=2)
    command = [sys.executable, "-c", "pass"]
    worker = actor.remote("w", command, str(root / "fixed.log"), str(root / "fixed.yaml"), "", {})
    ray.get(worker.run.remote())
    first_actor = time.perf_counter() - started - init
    ray.kill(worker)
    stop = time.perf_counter()
    ray.shutdown()
    return {"ray_init_s": init, "first_actor_s": first_actor, "shutdown_s": time.perf_counter() - stop}


def launcher_rounds(root: Path, rounds: int, steps: int, demo: bool, attached: bool = False) -> dict:
    """Alternating rounds of the launchers; the ratio is the median of the rounds' ratios.

    attached: a third variant, `--launcher ray` joining a Ray that this script keeps running (as with
    `ray start --head` once and `--address` for every run), so the run pays no `ray.init` nor shutdown."""
    address = None
    variants = ["local", "ray"]
    if attached:
        import ray

        from opd_cache.launch.ray_launcher import bind_ray_to_loopback

        bind_ray_to_loopback()
        ray.init(num_cpus=24, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        variants.append("ray-attached")
    runs = []
    try:
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            times = {}
            for variant in order:
                load = os.getloadavg()[0]
                launcher = "local" if variant == "local" else "ray"
                joined = address if variant == "ray-attached" else None
                times[variant] = launcher_wall_time(root / f"{variant}-{r}", launcher, steps, demo, joined)
                times[f"{variant}_load1"] = load
            times["ratio"] = times["ray"] / times["local"]
            if attached:
                times["attached_ratio"] = times["ray-attached"] / times["local"]
            runs.append(times)
            print(
                f"round {r}: " + ", ".join(f"{v} {times[v]:.1f} s" for v in variants) + f", ratio {times['ratio']:.2f}x"
            )
    finally:
        if attached:
            ray.shutdown()
    result = {"steps": steps, "rounds": runs, "median_ratio": statistics.median(t["ratio"] for t in runs)}
    if attached:
        result["median_attached_ratio"] = statistics.median(t["attached_ratio"] for t in runs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-launchers", action="store_true", help="Only (a) and (b).")
    parser.add_argument("--shards", type=int, default=None, help="Rollout shards of (a) and (b) (default 24).")
    parser.add_argument("--steps", type=int, default=None, help="Trainer steps of (c) (default 4).")
    parser.add_argument("--only-launchers", action="store_true", help="Only (c).")
    parser.add_argument("--demo", action="store_true", help="(c) on the demo's config (--steps of its 800).")
    parser.add_argument("--rounds", type=int, default=1, help="(c): alternating rounds of the two launchers.")
    parser.add_argument("--attached", action="store_true", help="(c) --rounds: also ray joining a running Ray.")
    args = parser.parse_args()
    shards, rows, steps = (6, 8, 2) if args.quick else (24, 16, 4)
    shards = args.shards or shards
    steps = args.steps or steps
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "shards": shards, "rows": rows}
    import ray

    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        root = Path(tmp)
        if args.only_launchers and args.rounds > 1:
            results["fixed_costs"] = ray_fixed_costs(root)
            print("Ray's fixed costs: " + ", ".join(f"{k} {v:.2f}" for k, v in results["fixed_costs"].items()))
            results["launchers"] = launcher_rounds(root, args.rounds, steps, args.demo, args.attached)
            results["launchers"]["config"] = "demo" if args.demo else "tiny"
            results["load_after"] = open("/proc/loadavg").read().strip()
            print(f"(c) median ratio over {args.rounds} rounds: {results['launchers']['median_ratio']:.2f}x")
            if args.attached:
                print(f"    joining a running Ray: {results['launchers']['median_attached_ratio']:.2f}x")
            tags = ("demo_" if args.demo else "", str(steps), "_rounds", "_attached" if args.attached else "")
            name = f"bench_ray_launchers_{''.join(tags)}.json"
            out = REPO / "benchmarks/results" / name
            out.write_text(json.dumps(results, indent=2) + "\n")
            print(f"wrote {out}")
            return
        if args.only_launchers:
            local = launcher_wall_time(root / "local", "local", steps, args.demo)
            on_ray = launcher_wall_time(root / "ray", "ray", steps, args.demo)
            results["launchers"] = {"steps": steps, "local_s": local, "ray_s": on_ray, "ratio": on_ray / local}
            results["launchers"]["config"] = "demo" if args.demo else "tiny"
            print(f"(c) opd run, {steps} steps: local {local:.1f} s, ray {on_ray:.1f} s, ratio {on_ray / local:.2f}x")
            out = REPO / f"benchmarks/results/bench_ray_launchers_{'demo_' if args.demo else ''}{steps}.json"
            out.write_text(json.dumps(results, indent=2) + "\n")
            print(f"wrote {out}")
            return
        ray.init(
            num_cpus=3,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )
        try:
            results["annotate"] = [annotate_under_ray(root, n, shards, rows) for n in (1, 2, 3)]
        finally:
            ray.shutdown()
        results["leases_s3"] = lease_requests_on_s3(shards, rows)
        if not args.skip_launchers:
            local = launcher_wall_time(root / "local", "local", steps)
            on_ray = launcher_wall_time(root / "ray", "ray", steps)
            results["launchers"] = {"steps": steps, "local_s": local, "ray_s": on_ray, "ratio": on_ray / local}

    base = results["annotate"][0]["tokens_per_s"]
    print(f"\n(a) annotate under Ray, {shards} shards x {rows} rows, shipped tiny teacher")
    print(f"{'workers':>7} {'seconds':>8} {'tok/s':>9} {'vs 1':>6} {'dup':>4}  shards per worker")
    for r in results["annotate"]:
        print(
            f"{r['workers']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>5.2f}x "
            f"{r['duplicates']:>4}  {sorted(r['shards_per_worker'].values())}"
        )
    lease = results["leases_s3"]
    print(
        f"\n(b) lease requests on S3: {lease['per_shard']:.2f} per shard over {lease['shards']} shards {lease['requests']}"
    )
    if "launchers" in results:
        la = results["launchers"]
        print(
            f"\n(c) opd run, {la['steps']} steps: local {la['local_s']:.1f} s, ray {la['ray_s']:.1f} s, ratio {la['ratio']:.2f}x"
        )
    out = REPO / "benchmarks/results/bench_ray.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
