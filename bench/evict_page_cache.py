#!/usr/bin/env python3
"""Drops every safetensors file under DIR from the page cache every PERIOD seconds until killed
(posix_fadvise POSIX_FADV_DONTNEED: only the clean pages no process maps, i.e. what a weight budget released), so
that each re-map reads storage: a base larger than the page cache, on a machine whose memory holds it.
Usage: bench/evict_page_cache.py DIR [PERIOD]"""
import glob
import os
import sys
import time

files = glob.glob(os.path.join(sys.argv[1], "**", "*.safetensors"), recursive=True)
period = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
while True:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    time.sleep(period)
