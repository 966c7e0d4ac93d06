"""The compiled (Numba) twins of the replay: the interference event loop (rates_kernel.py, run by
event_loop.py) and the level-2 build (build_kernel.py and step_kernel.py, run by level2.py), each
giving the Python code's result bit for bit, behind one switch (switch.py) that decides which runs and
loads them once."""
