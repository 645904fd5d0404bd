"""Bytes held on the cache, measured on the contexts of committed records, in the dtypes users run."""
