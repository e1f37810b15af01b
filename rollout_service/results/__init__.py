"""Results after the engine: the results file (file.py), the router's headers and the client's payloads
(payloads.py), rollout receipts (receipts.py) and a stream's lease on its results (stream.py).
`save_results`, `load_results` and `iter_results` are the results file's API."""
from rollout_service.results.file import iter_results, load_results, save_results

__all__ = ["iter_results", "load_results", "save_results"]
