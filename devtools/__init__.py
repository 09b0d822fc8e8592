"""Development tools of the repository (not part of the fp8mla package: ``src/`` never imports them).

``devtools.sass``: compile kernels for a GPU target without a GPU and read their SASS (registers, spills, shared
memory, instruction counts, a hash of the instruction stream); the sm_90 golden record the guard test compares with.
"""
