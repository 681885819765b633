"""Test beds for code built on kvtune, kept out of the runtime path (no runtime module imports
this package): import them in your own tests.

- :mod:`kvtune.testing.synthetic`: spans DataFrames with a known truth (fabric floor, bandwidth,
  prefill cost, conversations), in the shape ``kvtune.traces.load`` returns, and OTLP-JSON files.
- :mod:`kvtune.testing.standin`: stand-in vLLM prefill/decode servers speaking the P/D HTTP
  protocol (no model, no KV moved), for testing and benchmarking the router.
- :mod:`kvtune.testing.reference`: reference outputs of one plain vLLM server and the shared test
  prompts and conversations a P/D pair must reproduce.

Submodules are imported on demand (``from kvtune.testing import synthetic``): the stand-ins need
aiohttp and the references start vLLM servers.
"""
