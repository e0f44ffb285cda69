"""Engine adapters: ``vllm`` (a vLLM KV connector) and ``sglang`` (an SGLang HiCache backend).

This package file stays import-light on purpose: it must not import vllm or sglang, so
``import tiered_kv.connector`` works in processes that have neither. Load an adapter
by its module path (``tiered_kv.connector.vllm``), as the engines do.

Threading contract: nothing here; see each adapter module.
"""
