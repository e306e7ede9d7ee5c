"""The studies run with lightning_troll (see README.md here): scripts run by path, not imported;
this file makes their tests the package ``studies.tests``, apart from the library's ``tests``."""
