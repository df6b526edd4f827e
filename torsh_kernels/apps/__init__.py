"""Layer 6, the applications: the ``torsh`` command line (:mod:`.cli`), ``torsh demo`` (:mod:`.demo`),
``torsh tune`` (:mod:`.tune_cli`) and the benchmark suites with their harness (:mod:`.bench`). They
only compose the layers below; nothing in the library imports them."""
