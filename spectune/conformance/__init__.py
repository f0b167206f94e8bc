"""Conformance with the real SGLang: spectune's flags, defaults and adaptive schema, checked
against the source of every supported wheel (`make conformance`; docs/sglang.md "Conformance").

wheels.py   download and cache the listed wheels, verified by sha256
source.py   read the launch options and resolution code from a wheel by AST (never imported)
checks.py   compare them with what spectune emits and assumes
"""
