"""The engine as a Ray Serve deployment: one :class:`~voice_out.engine.engine.Engine` per
replica (one per GPU), reached from the voice_out server through streaming deployment handles.

* :mod:`.messages`: what crosses Ray between the front and a replica (plain dataclasses).
* :mod:`.relay`: the per-front text relay that carries an utterance's later text deltas (and
  playback acknowledgements) to the replica serving it.
* :mod:`.replica`: the deployment (``SpeechReplica``), its options and ``deploy``.
* :mod:`.client`: ``RayEngine``, an ``EngineLike`` over the deployment's handle, for the front.

Only :mod:`.messages` and :mod:`.relay`'s channel logic import without Ray; the rest needs the
``ray`` extra (``pip install 'voice_out[ray]'``). docs/scale-out.md ("Past one host: Ray
Serve") explains the design and its cost.
"""
