"""Benchmarks behind ``tcprec bench ...``: each module has a ``run(...)`` that times tcprec against
the best baseline in the same run, prints a table and writes JSON to ``benchmarks/results/``.
The shared methodology (do_bench medians, rotating buffers, environment record) is in
:mod:`tcprec.bench.common`.
"""
