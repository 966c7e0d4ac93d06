"""Ex-situ tracing: real PyTorch module code run under FakeTensorMode and a fake process group.

Public API: ``trace_stage``, ``trace_model``, ``ModelTraces`` (tracer.py) and ``TraceCache``
(cache.py). Importing this package does not import torch; tracing does.
"""

from echo_plan.trace.cache import TraceCache, TraceCacheWarning
from echo_plan.trace.tracer import ModelTraces, trace_model, trace_stage

__all__ = ["ModelTraces", "TraceCache", "TraceCacheWarning", "trace_model", "trace_stage"]
