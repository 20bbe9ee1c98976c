"""Durability: what a run leaves on disk so that it can be checked and resumed.

- ledger.py       ledger.jsonl and check(run_dir)
- streams.py      the record files as they grow, cut back to a checkpoint on resume
- rollouts.py     the rollout store (rollouts/<train node>.bin) that `flowrl replay` trains on again
- checkpoints.py  when checkpoints are taken, their atomic write, disk space
- snapshot.py     the coordinator's state in a checkpoint, and what a resume restores
- resume.py       a resumed run: its checkpoint verified, its record files cut back
- faults.py       FLOWRL_FAULT=<point>:<n>: kill -9 at a chosen point (durability tests)
"""
