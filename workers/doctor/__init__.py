"""`spectune doctor`: a GPU host checked for its first real run, with a support bundle.

checks.py   the checks, one line each (config, interpreter, SGLang version, GPUs, registry, argv)
bundle.py   the support bundle and its redaction (tokens, secrets, paths)
run.py      the command: the checks in order, `--launch`, the bundle, the exit status
"""
