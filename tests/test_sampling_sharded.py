"""The sampler on 8 fake CPU devices (data=2 x fsdp=2 x tensor=2) equals one device, with
the static, the continuous and the compacting engine."""

from __future__ import annotations

import pytest
from multidevice import run_with_devices

CODE = """
import jax, numpy as np
from flax import nnx
from grpojax.models import Decoder, make_mesh, shard_model, tiny_config
from grpojax.sampling import SamplingConfig, generate

model = Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))
prompts = np.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 4, 3], [0, 21, 22, 23, 24]])
lengths = np.array([3, 5, 2, 4])
kw = dict(key=jax.random.key(0), max_new_tokens=6, group_size=2,
          sampling=SamplingConfig(temperature=1.0, top_k=50), eos_ids=(1,))
one = generate(model, prompts, lengths, **kw)

mesh = make_mesh(data=2, fsdp=2, tensor=2)
shard_model(model, mesh)
for shared in (True, False):
    many = generate(model, prompts, lengths, mesh=mesh, shared_prefill=shared, **kw)
    spec = many.tokens_nt.sharding.spec
    print("shared_prefill", shared, "tokens sharding:", spec)
    assert len(many.tokens_nt.sharding.device_set) == 8
    assert spec[0] == ("data", "fsdp"), spec
    np.testing.assert_array_equal(np.asarray(one.tokens_nt), np.asarray(many.tokens_nt))
    np.testing.assert_array_equal(np.asarray(one.lengths_n), np.asarray(many.lengths_n))
    np.testing.assert_allclose(np.asarray(one.logp_nt), np.asarray(many.logp_nt), atol=1e-5)
# The continuous engine: one queue per data shard (4: data x fsdp), 3 slots rounded up to 4.
for slots in (3, 8):
    cont = generate(model, prompts, lengths, mesh=mesh, engine="continuous", slots=slots, **kw)
    print("continuous slots", slots, "steps", int(cont.decode_steps), "row-steps",
          int(cont.row_steps), "tokens sharding:", cont.tokens_nt.sharding.spec)
    assert int(cont.row_steps) == int(cont.decode_steps) * (4 if slots == 3 else 8)
    assert cont.tokens_nt.sharding.spec[0] == ("data", "fsdp")
    for name in ("tokens_nt", "lengths_n", "eos_found_n", "keep_count_nt"):
        a, b = (np.asarray(getattr(r, name)) for r in (one, cont))
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.asarray(one.logp_nt), np.asarray(cont.logp_nt), atol=1e-5)
# The compacting engine: rows compacted across the shards, sizes multiples of the 4 shards.
comp = generate(model, prompts, lengths, mesh=mesh, engine="compact", **kw)
print("compact steps", int(comp.decode_steps), "row-steps", int(comp.row_steps))
assert comp.tokens_nt.sharding.spec[0] == ("data", "fsdp")
for name in ("tokens_nt", "lengths_n", "eos_found_n", "keep_count_nt"):
    np.testing.assert_array_equal(np.asarray(getattr(one, name)), np.asarray(getattr(comp, name)))
np.testing.assert_allclose(np.asarray(one.logp_nt), np.asarray(comp.logp_nt), atol=1e-5)
print("OK")
"""


@pytest.mark.multidevice
def test_sharded_sampler_matches_single_device():
    out = run_with_devices(CODE, n_devices=8)
    print(out)
    assert "OK" in out
