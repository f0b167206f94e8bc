"""The lease protocol, one module per unit it serves (entry points in service.py).

Nothing is imported here, so `studies` can use `records` without importing the service.
"""
