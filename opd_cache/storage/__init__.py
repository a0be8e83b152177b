"""Shared dataset storage: the store, its layout and run manifest, shard files and their codecs.

The three stages meet only here. `Store` (store.py) is the entry point; layout.py names every path,
manifest.py holds run.json and the teacher records, listing.py lists shards, schema.py reads, writes and
validates shards (column types in columns.py, the packed codec in codec.py and quantize.py), integrity.py
checksums every file, retention.py decides what is kept, filestore.py does atomic I/O on `pyarrow.fs`.
"""
