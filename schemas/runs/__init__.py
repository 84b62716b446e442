"""The runs table group: ``runs``, ``sessions``, ``run_merges`` and ``messages``.

This package is the only code that speaks SQL to these tables; everything above it
(gateway/, processors/, scheduler/, topics/) calls its functions and classes.

* ``admission.py``: a run enters here, and only here (the one insert of a run, a batch
  of one for a single request); the ``published_at`` marks, the sweeper's claims of
  unpublished runs and their release, and the reads admission makes (a key's run, the
  budgets through schemas/ledger.py).
* ``control.py``: run control on behalf of a user (cancel, interrupt-merge, the mark of a
  cancel's published terminal event) and the run lists; every status write takes its
  source and target statuses from the state machine's edges (koda_runtime.lifecycle.states).
* ``reads.py``: what viewers read (run views, stream heads, events, session turns).
* ``worker.py``: the worker's writes (claim, transition, chunks, finish).
"""
