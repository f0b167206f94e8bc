"""The optimisation core: study specs, SGLang's EAGLE-3 rules, Optuna studies and result analysis.

Modules here import no web framework and no worker code; `spec`, `space` and `sglang` import
no Optuna either, so workers can use them to build launch commands.
"""
