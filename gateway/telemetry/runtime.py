"""Gauges of what a long-running server could leak, read at scrape time: the engines'
rows, the event loop's asyncio tasks, the process's threads and open file descriptors, and
the heap's freed bytes that malloc keeps (glibc).

A soak (benchmarks/soak.py) samples them with the memory series; once traffic stops each
must come back to where it was. Every series has fixed labels (none), so they cost the
same after a day as after a minute.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Callable, Optional

from prometheus_client.core import GaugeMetricFamily

from gateway.cpu.idle_trim import heap_bytes


def open_fds() -> Optional[int]:
    """Open file descriptors of this process (``/proc/self/fd`` on Linux, ``/dev/fd`` on
    macOS; the listing's own descriptor included); None where neither exists."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path))
        except OSError:
            continue
    return None


class RuntimeCollector:
    """``mlx_gateway_engine_rows`` (rows in the loaded models' batches, next-turn
    precomputes included), ``mlx_gateway_asyncio_tasks`` (tasks of the event loop the
    scrape runs on; absent when scraped off it), ``mlx_gateway_threads`` and
    ``mlx_gateway_open_fds``, and where glibc tells it ``mlx_gateway_heap_free_bytes``
    (:func:`gateway.cpu.idle_trim.heap_free_bytes`: memory freed, not held, resident until
    a trim: what tells a leak from the allocator keeping buffers) and
    ``mlx_gateway_heap_used_bytes`` (live ``malloc`` blocks, mapped ones included), and
    ``mlx_gateway_python_blocks`` (the interpreter's live small objects,
    ``sys.getallocatedblocks``): which of the three grows says where resident memory goes.

    Args:
        engines: the loaded models' engines now (each with a thread-safe ``num_running``).
    """

    def __init__(self, engines: Callable[[], list]):
        self.engines = engines

    def collect(self):
        rows = sum(e.num_running for e in self.engines())
        yield GaugeMetricFamily("mlx_gateway_engine_rows", "Rows in the loaded models' batches "
                                "(requests prefilling or decoding, next-turn precomputes).", value=rows)
        try:
            tasks = len(asyncio.all_tasks(asyncio.get_running_loop()))
        except RuntimeError:  # not scraped on the event loop
            tasks = None
        if tasks is not None:
            yield GaugeMetricFamily("mlx_gateway_asyncio_tasks", "Tasks of the server's asyncio event loop.",
                                    value=tasks)
        yield GaugeMetricFamily("mlx_gateway_threads", "Threads of the process.", value=threading.active_count())
        fds = open_fds()
        if fds is not None:
            yield GaugeMetricFamily("mlx_gateway_open_fds", "Open file descriptors of the process.", value=fds)
        heap = heap_bytes()
        if heap is not None:
            yield GaugeMetricFamily("mlx_gateway_heap_free_bytes", "Bytes malloc holds free in the process heap "
                                    "(glibc mallinfo2), counted in the resident size.", value=heap[1])
            yield GaugeMetricFamily("mlx_gateway_heap_used_bytes", "Bytes of live malloc blocks, mapped ones "
                                    "included (glibc mallinfo2).", value=heap[0])
        yield GaugeMetricFamily("mlx_gateway_python_blocks", "Memory blocks the Python interpreter has allocated "
                                "(sys.getallocatedblocks).", value=sys.getallocatedblocks())

    def describe(self):
        return []
