"""The algorithm-specific half of the loop: the train state and its jitted steps.

A trainer owns the checkpointed arrays of one algorithm (`state`, with `shardings`) and
answers three calls the loop makes every step:

  policy()                   the current policy as a decoder (for the sampler)
  logprobs(batch)            the trainer-side pass: policy logprobs and entropy (for the
                             sampler-vs-trainer metrics) and reference logprobs
  update(batch, logp, ref, ptx=None)
                             one jitted step; returns its metrics (device scalars); `ptx`
                             the step's PPO-ptx text (`grpojax.driver.ptx`) when the
                             step's ptx_coef > 0

`GRPOTrainer` (GRPO family: the batch carries rewards and the step computes the group
advantages inside its compiled program; on-policy distillation too, its reference a
frozen `Teacher`) and `PPOTrainer` (actor, critic and a frozen reference);
`make_trainer(cfg, model, mesh)` picks one.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.config import RunConfig
from grpojax.driver.checkpoint import Checkpointer, fingerprints
from grpojax.driver.setup import build_teacher
from grpojax.errors import UserError
from grpojax.models.lora import add_lora
from grpojax.models.precision import cast_floating, compute_dtype_of
from grpojax.rng import run_key
from grpojax.rollouts.strategy import rollout_arrays
from grpojax.train import (
    SFTBatch,
    create_train_state,
    grpo_batch_from_rows,
    make_grpo_step,
    make_optimizer,
    make_schedule,
    shard_train_state,
)
from grpojax.train.common import ADAPTERS_OFF, make_logprob_pass
from grpojax.train.config import GRPOConfig
from grpojax.train.packing import Packing
from grpojax.train.ppo import (
    PPOState,
    create_ppo_state,
    init_critic,
    make_ppo_step,
    ppo_batch_from_rows,
    shard_ppo_state,
)
from grpojax.train.rows import RowArrays, TrainBatch
from grpojax.train.state import Teacher, is_lora, join_trainable, split_params, trainable_split

__all__ = [
    "GRPOTrainer",
    "PPORunState",
    "PPOTrainer",
    "RunArrays",
    "Trainer",
    "checkpoint_target",
    "make_trainer",
]


def _shape(ptx: SFTBatch | None):
    """The ptx rows' shape (part of a compiled step's key), or None."""
    return None if ptx is None else ptx.tokens_ns.shape


def _layout(packing: Packing | None):
    """A packing's shapes (part of a compiled step's key: bins, width, slots), or None."""
    return None if packing is None else (packing.src_rw.shape, packing.rows_rj.shape[1])


class Trainer:
    """What the loop needs of an algorithm (see the module docstring). Subclasses set
    `state`, `shardings`, `graphdef` and implement the parameter accessors and `update`."""

    cfg: RunConfig
    mesh: Mesh
    graphdef: Any
    state: Any
    shardings: Any

    def _init_logprobs(self, forward) -> None:
        # The driver's batches are G samples per prompt, in contiguous groups.
        group = self.cfg.group_size if self.cfg.step_config.share_prompt else 1
        step = self.cfg.step_config
        chunks = step.num_minibatches * step.num_microbatches
        self._logprob_fn = make_logprob_pass(self.graphdef, forward, self.mesh, group, chunks)
        self._steps: dict[tuple, Callable] = {}

    def policy_params(self):
        raise NotImplementedError

    def ref_params(self):
        raise NotImplementedError

    # What an RL checkpoint holds of the train state. A LoRA run saves its adapters and
    # optimizer state, not the frozen base weights (rebuilt on restore, and checked against
    # the fingerprint saved with the checkpoint); other runs save the whole state.

    def checkpoint_state(self):
        """The train state as an RL checkpoint holds it."""
        return self.state

    def checkpoint_shardings(self):
        return self.shardings

    def with_checkpoint_state(self, saved):
        """The full train state from a restored `checkpoint_state()`."""
        return saved

    def base_params(self):
        """A LoRA run's frozen base weights (`nnx.State`), else None."""
        return None

    def base_fingerprint(self) -> list[int] | None:
        """Per-leaf fingerprints of `base_params()` (computed once: the base never changes)."""
        return self._fingerprint_once("_base_fingerprint", self.base_params())

    def _fingerprint_once(self, slot: str, frozen) -> list[int] | None:
        """`fingerprints(frozen)` kept in attribute `slot` (None when `frozen` is None); a
        setter of the frozen weights resets the slot to None."""
        if frozen is None:
            return None
        if getattr(self, slot, None) is None:
            setattr(self, slot, fingerprints(frozen))
        return getattr(self, slot)

    def set_base_params(self, base) -> None:
        raise NotImplementedError

    def teacher_params(self):
        """Algo "distill"'s frozen teacher weights, else None."""
        return None

    def teacher_fingerprint(self) -> list[int] | None:
        """Per-leaf fingerprints of `teacher_params()` (computed once), recorded in every RL
        checkpoint so that a resume with another teacher is refused (`check_teacher_weights`)."""
        return self._fingerprint_once("_teacher_fingerprint", self.teacher_params())

    def update(self, batch: TrainBatch, logp, ref_logp, ptx: SFTBatch | None = None) -> dict:
        raise NotImplementedError

    def policy(self):
        """The current policy as a decoder (shares the state's arrays)."""
        return nnx.merge(self.graphdef, self.policy_params())

    def logprobs(self, batch: TrainBatch, *, with_policy: bool = True):
        """(policy logp, entropy, ref logp), each `[N, T]` or None.

        The policy's logp feeds the sampler-vs-trainer metrics and, when the step runs more
        than one update on the batch, is its pi_old; with the keep-sampling mask it is over
        the sampler's kept set, like the step's own.
        """
        keep = not self.cfg.is_ppo and self.cfg.step_config.use_keep_mask
        return self._logprob_fn(
            self.policy_params(),
            self._ref_for_logprobs(),
            batch.tokens_ns,
            batch.mask_ns,
            batch.completion_mask_nt,
            batch.keep_count_nt if keep else None,
            batch.packing,
            batch.routing_nslk,
            with_policy=with_policy,
        )

    def _ref_for_logprobs(self):
        """The reference whose logprobs the step needs from this pass (None: none)."""
        return self.ref_params()

    def _step(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        """The compiled step for a batch layout (built once per shape)."""
        if key not in self._steps:
            self._steps[key] = build()
        return self._steps[key]


class GRPOTrainer(Trainer):
    """GRPO family: `state` is one `grpojax.train.TrainState` (policy, optimizer, shuffle
    key, optional reference). Algo "distill": the reference is the frozen teacher
    (`grpojax.train.state.Teacher`, built from `distill.teacher`), which checkpoints leave
    out (it is rebuilt from the config on resume).

    `reward_weights`: the reward manager's weights, one per reward function; they become
    the step's `gdpo_weights` when the estimator takes per-function rewards (`rewards_nr`,
    e.g. "gdpo") and `grpo.gdpo_weights` is not set.
    """

    def __init__(
        self,
        cfg: RunConfig,
        model,
        mesh: Mesh,
        *,
        reward_weights: Sequence[float] | None = None,
        teacher_dir: pathlib.Path | None = None,
    ):
        self.cfg, self.mesh = cfg, mesh
        self.step_config = _with_gdpo_weights(cfg, reward_weights)
        opt = cfg.optimizer_for("optimizer")
        self.tx = make_optimizer(opt)
        self.schedule = make_schedule(opt)
        if cfg.lora.enabled:
            # Adapters on the (warm-started) policy: only they train, and the reference is
            # the same base weights with adapters off (create_train_state keeps no copy).
            lora_rngs = nnx.Rngs(run_key(cfg.seed, "lora_init"))
            add_lora(model, cfg.lora.lora_config(), rngs=lora_rngs)
        self.distill = cfg.algo == "distill"
        self.graphdef, state = create_train_state(
            model,
            self.tx,
            rng=run_key(cfg.seed, "train_state"),
            kl_controller=None,
            with_ref=cfg.step_config.uses_reference and not self.distill,
        )
        if self.distill:
            teacher = build_teacher(cfg, model.config, mesh=mesh, path=teacher_dir)
            state = state.replace(ref_params=Teacher(*split_params(teacher)))
        self.state, self.shardings = shard_train_state(state, self.tx, mesh)
        self._init_logprobs(cfg.step_config.forward)

    def policy_params(self):
        return self.state.params

    def ref_params(self):
        return self.state.ref_params

    def _saved(self, tree):
        """`tree` (the state or its shardings) as a checkpoint holds it: LoRA's adapters
        without the base weights, no teacher."""
        if is_lora(self.state.params):
            tree = tree.replace(params=trainable_split(tree.params)[0])
        return tree.replace(ref_params=None) if self.distill else tree

    def checkpoint_state(self):
        return self._saved(self.state)

    def checkpoint_shardings(self):
        return self._saved(self.shardings)

    def with_checkpoint_state(self, saved):
        if is_lora(self.state.params):
            saved = saved.replace(params=join_trainable(saved.params, self.base_params()))
        return saved.replace(ref_params=self.state.ref_params) if self.distill else saved

    def base_params(self):
        return trainable_split(self.state.params)[1] if is_lora(self.state.params) else None

    def teacher_params(self):
        return self.state.ref_params.params if self.distill else None

    def set_base_params(self, base) -> None:
        adapters = trainable_split(self.state.params)[0]
        self.state = self.state.replace(params=join_trainable(adapters, base))
        self._base_fingerprint = None

    def _ref_for_logprobs(self):
        # kl_estimator="full": the step runs the reference itself, for its hidden states.
        if self.cfg.step_config.kl_estimator == "full":
            return None
        if self.cfg.step_config.uses_reference and is_lora(self.state.params):
            return ADAPTERS_OFF  # the same base weights, adapters off: no copy
        return self.ref_params()

    def update(self, batch: TrainBatch, logp, ref_logp, ptx: SFTBatch | None = None) -> dict:
        """One jitted GRPO step on `batch`: the group advantages are computed inside it from
        the batch's rewards (`GRPOBatch.rewards_n`, and `greedy_rewards_n` / `rewards_nr`
        when the estimator asks for them), with failed samples left out."""
        g = self.step_config
        single = g.num_epochs == 1 and g.num_minibatches == 1
        # The trainer-side pass already has pi_old: the step need not recompute it. One
        # update needs none (its own forward is), unless the KL is in the reward.
        old = None if (single and not g.reward_kl_coef) or logp is None else logp
        b = grpo_batch_from_rows(batch, g, old_logp_nt=old, ref_logp_nt=ref_logp, ptx=ptx)
        step = self._step(
            ("grpo", b.tokens_ns.shape, b.old_logp_nt is None, _shape(b.ptx), _layout(b.packing)),
            lambda: make_grpo_step(
                self.graphdef,
                self.tx,
                g,
                mesh=self.mesh,
                state_shardings=self.shardings,
                batch=b,
                schedule=self.schedule,
            ),
        )
        self.state, metrics = step(self.state, b)
        return metrics


@flax.struct.dataclass
class PPORunState:
    """PPO's checkpointed arrays: actor and critic (`PPOState`) and the frozen reference
    policy's parameters (a copy of the actor at RL step 0; None with LoRA, whose reference
    is the actor's base, with `ppo.kl_estimator=full`, where the actor's state holds the
    copy because the step runs the reference itself, and with `ppo.kl_coef=0`: no
    reference)."""

    ppo: PPOState
    ref_params: Any


class PPOTrainer(Trainer):
    """PPO: actor and critic (separate or shared backbone) plus a frozen reference (none at
    kl_coef = 0)."""

    def __init__(self, cfg: RunConfig, model, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        # The step's groups of shared prompts are the driver's G samples per prompt.
        self.step_config = cfg.step_config
        opt, copt = cfg.optimizer_for("optimizer"), cfg.optimizer_for("critic_optimizer")
        self.tx, self.schedule = make_optimizer(opt), make_schedule(opt)
        self.critic_tx, self.critic_schedule = make_optimizer(copt), make_schedule(copt)
        critic = init_critic(
            model, mode=cfg.ppo.critic, rngs=nnx.Rngs(run_key(cfg.seed, "critic_init"))
        )
        if cfg.lora.enabled:
            # The shared critic's head reads the adapted actor's hidden states (config.py
            # refuses a separate critic with LoRA).
            add_lora(model, cfg.lora.lora_config(), rngs=nnx.Rngs(run_key(cfg.seed, "lora_init")))
        self.graphs, ppo_state = create_ppo_state(
            model,
            critic,
            self.tx,
            self.critic_tx,
            config=cfg.ppo,
            rng=run_key(cfg.seed, "train_state"),
        )
        ppo_state, ppo_shardings = shard_ppo_state(ppo_state, self.tx, self.critic_tx, mesh)
        self.graphdef = self.graphs.actor
        actor = ppo_state.actor.params
        # LoRA: the reference is the actor's base, adapters off; kl_estimator="full": the
        # actor's state holds the reference (create_ppo_state), for the step; kl_coef=0: no
        # reference. No copy here.
        uses_ref = cfg.ppo.uses_reference
        if is_lora(actor) or ppo_state.actor.ref_params is not None or not uses_ref:
            self.state = PPORunState(ppo=ppo_state, ref_params=None)
            self.shardings = PPORunState(ppo=ppo_shardings, ref_params=None)
        else:
            # The frozen reference in the compute dtype (the actor keeps float32 masters).
            ref = cast_floating(jax.tree.map(jnp.copy, actor), compute_dtype_of(model))
            self.state = PPORunState(ppo=ppo_state, ref_params=ref)
            self.shardings = PPORunState(ppo=ppo_shardings, ref_params=ppo_shardings.actor.params)
        self._init_logprobs(cfg.ppo.forward)

    def policy_params(self):
        return self.state.ppo.actor.params

    def ref_params(self):
        if self.state.ref_params is None:  # kl_estimator="full": in the actor's state
            return self.state.ppo.actor.ref_params
        return self.state.ref_params

    def _ref_for_logprobs(self):
        # kl_estimator="full": the step runs the reference itself, for its hidden states;
        # kl_coef=0: no reference.
        if self.cfg.ppo.kl_estimator == "full" or not self.cfg.ppo.uses_reference:
            return None
        return ADAPTERS_OFF if is_lora(self.policy_params()) else self.ref_params()

    def _with_actor_params(self, tree, params):
        ppo = tree.ppo.replace(actor=tree.ppo.actor.replace(params=params))
        return tree.replace(ppo=ppo)

    def checkpoint_state(self):
        if not is_lora(self.policy_params()):
            return self.state
        return self._with_actor_params(self.state, trainable_split(self.policy_params())[0])

    def checkpoint_shardings(self):
        if not is_lora(self.policy_params()):
            return self.shardings
        sh = trainable_split(self.shardings.ppo.actor.params)[0]
        return self._with_actor_params(self.shardings, sh)

    def with_checkpoint_state(self, saved):
        if not is_lora(self.policy_params()):
            return saved
        params = join_trainable(saved.ppo.actor.params, self.base_params())
        return self._with_actor_params(saved, params)

    def base_params(self):
        params = self.policy_params()
        return trainable_split(params)[1] if is_lora(params) else None

    def set_base_params(self, base) -> None:
        adapters = trainable_split(self.policy_params())[0]
        self.state = self._with_actor_params(self.state, join_trainable(adapters, base))
        self._base_fingerprint = None

    def update(self, batch: TrainBatch, logp, ref_logp, ptx: SFTBatch | None = None) -> dict:
        """One jitted PPO step: KL-shaped rewards, GAE and the clipped losses inside it."""
        b = ppo_batch_from_rows(batch, self.step_config, ref_logp_nt=ref_logp, ptx=ptx)
        step = self._step(
            ("ppo", b.tokens_ns.shape, _shape(b.ptx), _layout(b.packing)),
            lambda: make_ppo_step(
                self.step_config,
                self.graphs,
                self.tx,
                self.critic_tx,
                mesh=self.mesh,
                state=self.state.ppo,
                batch=b,
                actor_schedule=self.schedule,
                critic_schedule=self.critic_schedule,
            ),
        )
        ppo, metrics = step(self.state.ppo, b)
        self.state = self.state.replace(ppo=ppo)
        return metrics


def _with_gdpo_weights(cfg: RunConfig, reward_weights: Sequence[float] | None) -> GRPOConfig:
    """`cfg.step_config` (GRPO), its `gdpo_weights` filled from the reward manager's weights
    when the estimator takes per-function rewards and the field is None; a set field must
    have one weight per reward function."""
    g = cfg.step_config
    if "rewards_nr" not in cfg.batch_inputs or reward_weights is None:
        return g
    if g.gdpo_weights is None:
        return dataclasses.replace(g, gdpo_weights=tuple(float(w) for w in reward_weights))
    if len(g.gdpo_weights) != len(reward_weights):
        raise UserError(
            f"grpo.gdpo_weights must have one weight per reward function "
            f"({len(reward_weights)}), got {len(g.gdpo_weights)}"
        )
    return g


def make_trainer(
    cfg: RunConfig,
    model,
    mesh: Mesh,
    *,
    reward_weights: Sequence[float] | None = None,
    teacher_dir: pathlib.Path | None = None,
) -> Trainer:
    """The trainer of `cfg.algo` around `model` (its parameters become the policy's).
    `reward_weights`: the reward manager's, for GDPO; `teacher_dir`: algo "distill"'s
    teacher, checked by the run (`Run.teacher_dir`; None: checked here) (`GRPOTrainer`)."""
    if cfg.is_ppo:
        return PPOTrainer(cfg, model, mesh)
    return GRPOTrainer(cfg, model, mesh, reward_weights=reward_weights, teacher_dir=teacher_dir)


@flax.struct.dataclass
class RunArrays:
    """The arrays of an RL checkpoint: the trainer's state, the sampler's key, the rows
    of the dynamic-sampling buffer (`RowArrays`, capacity N rows) and of the rounds sampled
    ahead (`rollout.max_staleness` slots of N rows, `grpojax.rollouts.pipeline`; with
    `rollout.partial` one `grpojax.sampling.partial.Window` of the rounds in flight)."""

    train: Any
    sample_key: jax.Array
    buffer: RowArrays
    pending: tuple = ()


def checkpoint_target(trainer: Trainer, mesh: Mesh) -> tuple[RunArrays, RunArrays]:
    """(abstract arrays, shardings) to restore a `RunArrays` checkpoint onto `trainer`'s
    layout on `mesh` (the structure comes from the freshly built trainer)."""
    buffer, pending = rollout_arrays(trainer.cfg, mesh)
    abstract = RunArrays(
        train=trainer.checkpoint_state(),
        sample_key=jax.random.key(0),
        buffer=buffer,
        pending=pending,
    )
    shardings = RunArrays(
        train=trainer.checkpoint_shardings(),
        sample_key=NamedSharding(mesh, PartitionSpec()),
        buffer=jax.tree.map(lambda x: x.sharding, buffer),
        pending=jax.tree.map(lambda x: x.sharding, pending),
    )
    return abstract, shardings


# ----------------------------------------------------------------------------------------
# LoRA runs: the base weights beside adapter-only RL checkpoints
# ----------------------------------------------------------------------------------------

BASE_FINGERPRINT_KEY = "lora_base_fingerprint"  # in an RL checkpoint's driver state
TEACHER_FINGERPRINT_KEY = "teacher_fingerprint"  # likewise: algo "distill"'s teacher


def lora_base_dir(rl_dir) -> pathlib.Path:
    """Where a LoRA run whose base is not `model.source` as it is (an SFT warm start) keeps
    its base weights: one Orbax checkpoint, written once before RL checkpoint 0."""
    rl_dir = pathlib.Path(rl_dir)
    return rl_dir.with_name(rl_dir.name + "-lora-base")


def _base_is_saved(cfg: RunConfig) -> bool:
    return cfg.sft.steps > 0


def save_lora_base(trainer: Trainer, cfg: RunConfig, rl_dir) -> None:
    """Write the base weights of a warm-started LoRA run (no-op otherwise)."""
    base = trainer.base_params()
    if base is None or not _base_is_saved(cfg):
        return
    with Checkpointer(lora_base_dir(rl_dir), keep=1, async_save=False) as ckpt:
        ckpt.clear()  # a run stopped before its RL checkpoint 0 may have left one
        ckpt.save(0, base, force=True)


def restore_lora_base(trainer: Trainer, cfg: RunConfig, rl_dir) -> None:
    """Put a warm-started LoRA run's saved base weights into `trainer` (no-op otherwise)."""
    base = trainer.base_params()
    if base is None or not _base_is_saved(cfg):
        return
    directory = lora_base_dir(rl_dir)
    with Checkpointer(directory, keep=1, async_save=False) as ckpt:
        if 0 not in ckpt.all_steps():
            raise UserError(
                f"{directory} holds no base weights: the LoRA adapters of {rl_dir} cannot be "
                "restored without the warm-started base they were trained on"
            )
        shardings = jax.tree.map(lambda x: x.sharding, base)
        trainer.set_base_params(ckpt.restore(0, base, shardings=shardings).state)


def check_lora_base(trainer: Trainer, driver_state: dict, where: str) -> None:
    """Refuse adapters restored onto a base other than the one they were trained on."""
    want = driver_state.get(BASE_FINGERPRINT_KEY)
    got = trainer.base_fingerprint()
    if want is None and got is None:
        return
    if want is None or got is None:
        raise UserError(
            f"{where}: the checkpoint {'has no' if want is None else 'holds'} LoRA adapters "
            f"but this run's config {'has' if want is None else 'has no'} lora.rank > 0"
        )
    if list(want) != list(got):
        source = trainer.cfg.model.source
        raise UserError(
            f"{where}: these LoRA adapters were trained on a different base model: the base "
            f"weights' fingerprint differs from the checkpoint's (model.source={source!r}); "
            "resume onto the base checkpoint the adapters were trained on"
        )


def check_teacher_weights(trainer: Trainer, driver_state: dict, where: str) -> None:
    """Refuse a distillation run resumed with a teacher other than the one it was trained
    with (the teacher's fingerprint against the checkpoint's; a checkpoint without one,
    or a run without a teacher, is not checked)."""
    want, got = driver_state.get(TEACHER_FINGERPRINT_KEY), trainer.teacher_fingerprint()
    if want is not None and got is not None and list(want) != list(got):
        raise UserError(
            f"{where}: distill.teacher={trainer.cfg.distill.teacher!r} is not the teacher this "
            "run was trained with (its weights' fingerprint differs from the checkpoint's); "
            "resume with that teacher, or start a new run"
        )
