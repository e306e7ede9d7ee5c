"""Tasks: what a user brings to define a task, each part in its own package.

- :mod:`lightning_troll.tasks.data`: the prompts and the DataModule (the ``data`` section):
  where rows come from and how a row becomes a prompt;
- :mod:`lightning_troll.tasks.rewards`: the rewards (``model.rewards``): the registry and scorer,
  the built-in rewards, reward workers and reward models;
- :mod:`lightning_troll.tasks.environments`: tools and environments (``model.episodes``): tools
  as plain functions, the environment protocol, conversations rendered.

Layered like the rooms (``docs/architecture.md``): ``environments`` may import ``rewards`` and
``data``, ``rewards`` neither. Nothing is imported here: each part loads on its own.
"""
