"""Tiers below the KV pool. base.py is what the KV cache manager sees of a tier (a leaf: the manager imports nothing
else from here); the disk tier is disk.py (the adapter) over store.py (files, cap, writer thread), chain_read.py
(a prefix's records read ahead and checked), record.py (the file format), files.py (file system calls) and cost.py
(read or recompute)."""
