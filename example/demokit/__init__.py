"""The pieces `python -m example.demo` is built from: services, processes, orders, report."""
