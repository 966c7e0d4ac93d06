"""Ex-situ tracing: real PyTorch module code run under FakeTensorMode and a fake process group.

Entry points: ``trace_stage``, ``trace_model`` and ``ModelTraces`` in ``tracer.py``, ``TraceCache`` in
``cache.py``. The package imports nothing itself, so a module that needs one part (the records, the
cache) does not load the tracer, and importing it never imports torch; tracing does.
"""
