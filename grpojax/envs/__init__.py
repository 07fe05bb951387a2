"""Environments for agentic multi-turn RL: episodes played token in, token out.

    base     `Environment` (one per episode: reset / step / reward; the seats of a shared
             game: seats / table / poll), `Step`, `RawText` (text taken as written),
             `load_environment("package.module:Class")`.
    episode  `Episode` as token segments (policy ids with their sampler logprobs, env ids
             without), `EpisodeRunner` (steps N environments concurrently between the
             sampler's turns and renders their observations to ids, once),
             `render_prompt` / `render_observation`, `pad_episodes`,
             `demonstration_episodes` (the envs' scripted experts played: SFT data).
    tools    tools as plain functions: `tool_schema`, `parse_tool_calls` (Qwen / Hermes
             `<tool_call>` JSON), `tools_prompt`, `ToolEnvironment`.
    builtin  `CalculatorEnv`, `PythonToolEnv` (the code reward's sandbox), `GuessNumberEnv`,
             and their row generators.
    agent    `agent_environment(fn)`: an agent that only knows the OpenAI client, its calls
             served by `AgentEndpoint` (loopback, OpenAI-compatible) as the episode's turns.
    registry `ENVIRONMENTS` (the built-ins by config name), `resolve_environment`,
             `environment_rows` (a built-in's train / held-out rows, split by content).
    rollout  `rollout_episodes` (the multi-turn sampler's turns and the runner's answers,
             until every episode ends; `rollout_episodes_external` on an external engine
             such as vLLM), `episode_batch` (episodes as the trainer's rows).

Layering: above the sampler and the rewards (`rollout` drives `grpojax.sampling.multiturn`;
the other modules are plain Python: sandbox, verifiers, errors, user code); below the
trainer's driver, which imports this.
"""

from grpojax.envs.agent import AgentEndpoint, AgentEnvironment, agent_environment
from grpojax.envs.base import Environment, RawText, Step, load_environment
from grpojax.envs.builtin import (
    CalculatorEnv,
    GuessNumberEnv,
    PythonToolEnv,
    calculator,
    evaluate_arithmetic,
    expert_uses_tool,
    final_number,
    guess_number_rows,
    multiplication_rows,
)
from grpojax.envs.episode import (
    DONE_REASONS,
    PLAIN_OBSERVATION_FORMAT,
    Episode,
    EpisodeBatch,
    EpisodeRunner,
    Segment,
    demonstration_episodes,
    make_environments,
    pad_episodes,
    render_observation,
    render_prompt,
)
from grpojax.envs.registry import (
    ENVIRONMENTS,
    environment_rows,
    is_heldout,
    resolve_environment,
)
from grpojax.envs.rollout import (
    EpisodeRows,
    episode_batch,
    rollout_episodes,
    rollout_episodes_external,
)
from grpojax.envs.tools import (
    ParseError,
    ToolCall,
    ToolEnvironment,
    parse_tool_calls,
    plain_tools_listing,
    tool_schema,
    tools_prompt,
)

__all__ = [
    "DONE_REASONS",
    "ENVIRONMENTS",
    "PLAIN_OBSERVATION_FORMAT",
    "AgentEndpoint",
    "AgentEnvironment",
    "CalculatorEnv",
    "Environment",
    "Episode",
    "EpisodeBatch",
    "EpisodeRows",
    "EpisodeRunner",
    "GuessNumberEnv",
    "ParseError",
    "PythonToolEnv",
    "RawText",
    "Segment",
    "Step",
    "ToolCall",
    "ToolEnvironment",
    "agent_environment",
    "calculator",
    "demonstration_episodes",
    "environment_rows",
    "episode_batch",
    "evaluate_arithmetic",
    "expert_uses_tool",
    "final_number",
    "guess_number_rows",
    "is_heldout",
    "load_environment",
    "make_environments",
    "multiplication_rows",
    "pad_episodes",
    "parse_tool_calls",
    "plain_tools_listing",
    "render_observation",
    "render_prompt",
    "resolve_environment",
    "rollout_episodes",
    "rollout_episodes_external",
    "tool_schema",
    "tools_prompt",
]
