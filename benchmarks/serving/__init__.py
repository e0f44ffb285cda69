"""Helpers of ``benchmarks/serve_bench.py`` (the ``vllm serve`` load benchmark, issue 14).

Modules: ``shapes`` (model configs, dummy-weight model dirs), ``workload`` (multi-turn
conversations and phases), ``modes`` (one ``vllm serve`` command line and environment per
connector mode), ``server`` (start, health, scrape, stop), ``client`` (the asyncio + aiohttp load
generator), ``stats`` (percentiles, inter-token latency, Prometheus deltas), ``report`` (summary
over engine starts, table, JSON, plot).

Only ``client`` needs aiohttp and only ``report.plot`` needs matplotlib, both imported when used:
``--dry-run`` and ``--plot-from`` run with neither a GPU nor vLLM.
"""
