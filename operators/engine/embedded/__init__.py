"""flowrl's own torch engine: `engine.py` (EmbeddedEngine), its model (`model.py`, `model_vl.py`,
`load.py`), shared prefill (`prefill.py`), image requests (`vl_requests.py`) and how a weight version
is taken (`weights.py`). Reading order: operators/engine/README.md."""
