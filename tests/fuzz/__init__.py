"""Differential fuzzer: random small programs, run through ``sp.parallelize`` and
compared with ``jax.jit`` on one device.

    python -m tests.fuzz --n 10000 --seed 7 --jobs 2          # the long run
    python -m tests.fuzz --seed 7 --index 123                 # one program: print, run, shrink
    python -m tests.fuzz --list-features                      # op families and switches
    python -m tests.fuzz --n 500 --features reshape,marks,elementwise --without invalid

Modules, one job each:
  program.py     the data model (instructions over named values) and type inference
  ops.py         op families: drawing operands, inferring types, rendering, factor keys
  strategies.py  drawing valid strategies, planting invalid ones, judging a program
  generate.py    a program from (seed, index)
  render.py      a program as a runnable snippet (the fuzzer executes exactly that text)
  oracle.py      running both ways, comparing, classifying the outcome
  shrink.py      greedy shrinking to a minimal program that fails the same way
  runner.py      many programs in worker processes, the report
Shrunk repros are written to fuzz_failures/ (ignored by git); each runs on its own.
"""
