"""Glue for the frameworks users train in, where a plain documented call is not enough: Lightning
(:mod:`.lightning`), Accelerate and the Hugging Face ``Trainer`` (:mod:`.accelerate`, :mod:`.hf_trainer`), torchtitan
(:mod:`.torchtitan`). Importing this package imports no framework; each module imports its framework when it is
imported itself. What each framework needs, and what it already offers (where torsh adds nothing): docs/integrations.md.
"""
