"""Environments for multi-turn episodes: tools as plain Python functions, the environment
protocol, and how a conversation and an environment's replies are rendered.

- :mod:`~lightning_troll.tasks.environments.tools`: a tool's JSON schema from its signature and
  docstring (``model.episodes.tools``), its arguments checked, its result rendered;
- :mod:`~lightning_troll.tasks.environments.calls`: ``<tool_call>`` blocks parsed from the model's
  output, one call run;
- :mod:`~lightning_troll.tasks.environments.tool_workers`: :class:`ToolRunner`, the calls run in this
  process or in worker processes with a timeout (``model.episodes.tool_workers``, ``model.episodes.tool_timeout``),
  every failure an error message for the model;
- :mod:`~lightning_troll.tasks.environments.rendering`: :class:`Conversation`, an episode through the
  chat template, the tools shown where the template cannot;
- :mod:`~lightning_troll.tasks.environments.protocol`: :class:`Environment` and :class:`Step`
  (``model.episodes.environment``);
- :mod:`~lightning_troll.tasks.environments.tool_env`: :class:`ToolEnvironment`, the environments of a
  batch stepped together;
- :mod:`~lightning_troll.tasks.environments.trl_env`: :class:`TrlEnvironment`, an environment written
  for TRL's ``environment_factory`` used as it is;
- :mod:`~lightning_troll.tasks.environments.factory`: :class:`EnvironmentFactory`, an environment per
  episode from ``model.episodes`` (fresh, or reset from a pool for one in TRL's form).

The episode loop itself, at token level, is
:func:`lightning_troll.rollouts.episodes.run_episodes`. No Lightning here.
"""

from lightning_troll.tasks.environments.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedCall,
    ToolCall,
    parse_tool_calls,
)
from lightning_troll.tasks.environments.factory import EnvironmentChoice, EnvironmentFactory
from lightning_troll.tasks.environments.protocol import Environment, Step, load_environment
from lightning_troll.tasks.environments.rendering import (
    Conversation,
    template_support,
    tool_section,
)
from lightning_troll.tasks.environments.tool_env import ToolEnvironment, step_all
from lightning_troll.tasks.environments.tool_workers import ToolResult, ToolRunner
from lightning_troll.tasks.environments.tools import Tool, load_tool, load_tools
from lightning_troll.tasks.environments.trl_env import TrlEnvironment, is_trl_environment

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Conversation",
    "Environment",
    "EnvironmentChoice",
    "EnvironmentFactory",
    "MalformedCall",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "ToolRunner",
    "TrlEnvironment",
    "is_trl_environment",
    "load_environment",
    "load_tool",
    "load_tools",
    "parse_tool_calls",
    "step_all",
    "template_support",
    "tool_section",
]
