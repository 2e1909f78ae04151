"""Tools for kernel engineers that read what the CuTe DSL compiles, without a GPU (not
installed with the package; run from the repository root):

* ``tools/sass_digest.py`` -- a digest of every fast kernel's SASS, to show a refactor
  leaves the machine code unchanged;
* ``tools/sass_budget.py`` -- the instructions per 512 B of weights in the experts
  engine's main loops, read from the SASS;
* ``tools/ptx_dump.py`` -- the DSL's PTX and cubin dumps of a compile in a subprocess, and
  the ELF sections of a cubin (the tests of which instructions a kernel issues use it).
"""
