"""The study machinery's tests: the studies in ``studies/`` (their runs, grids, tables, plots,
statistics, records and plans), apart from the library's tests in ``tests/``, which import no
study script (``tests/test_layout.py`` checks that). ``make test`` runs both folders."""
