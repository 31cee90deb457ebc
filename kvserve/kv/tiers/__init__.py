"""Tiers below the KV pool. base.py is what the KV cache manager sees of a tier (a leaf: the manager imports nothing
else from here); the disk tier is disk.py (the adapter, its reads on readers.py's daemon threads) over store.py
(records read and written), with writer.py (the writer thread), index.py (the records under the directory, LRU and
cap), directory.py (creating, trusting and scanning the directory), rejections.py (records not used: counted,
removed or skipped), chain_read.py (a prefix's records read ahead and checked), record.py (the file format),
files.py (file system calls) and cost.py (read or recompute)."""
