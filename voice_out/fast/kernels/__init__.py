"""Triton kernels of the fast path: the decode step's (``decode``), the flow estimator's
(``flow``), the vocoder's (``vocoder``), how they are launched (``launch``) and compiled ahead
at start-up (``precompile``). Only fast/ and the engine's assembly import them; model/ never does."""
