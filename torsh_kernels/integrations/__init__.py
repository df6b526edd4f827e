"""Glue for the frameworks users train in, where a plain documented call is not enough: Lightning
(:mod:`.lightning`), Accelerate and the Hugging Face ``Trainer`` (:mod:`.accelerate`, :mod:`.hf_trainer`), torchtitan
(:mod:`.torchtitan`), and the per-rank checkpoint files they share (:mod:`.rank_state`). Importing this package
imports no framework; a module imports at most its own framework, when it is imported itself. What each framework
needs, and what it already offers (where torsh adds nothing): docs/integrations.md.
"""
