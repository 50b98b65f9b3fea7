"""FSDP2 + distributed checkpoint, multi-process (gloo on CPU; 1-3 spawned ranks).

Each test launches a few processes running a worker from ``fsdp_workers.py`` (a tiny
transformer: per-block ``fully_shard`` plus the root; weights that shard unevenly and,
on 3 ranks, emptily). A failure on any rank fails the test; the process-group timeout
(60 s) turns a hang into a failure.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_workers as W

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]


def test_fsdp_parity_offload_bf16_and_errors():
    """Acceptance 1, 3, 7, 8, 10 and the failure rules, on 2 ranks:
    - AdamW 8-bit / 4-bit / 4-bit rank-1 / FP8, AdEMAMix 8-bit and Muon 8-bit / 4-bit / fp32, 6 steps: losses, params and every gathered state
      (codes, scales) equal the unsharded run with all-reduced gradients, bit for bit;
    - every state the global rule quantizes is quantized on every (uneven) shard;
    - CPUOffloadPolicy(pin_memory=False): same, states on the params' device;
    - bf16 params with stochastic rounding;
    - an unsupported op raises on every rank;
    - format_state_report: one line per rank (each rank's own bytes) and a whole-model total
      equal to the unsharded optimizer's state bytes and param count."""
    W.launch(W.parity_all_worker, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_muon_fsdp_exact_at_1_2_3_ranks(world):
    """Muon 8-bit / 4-bit / fp32 momentum (AdamW on the 1-D params) under FSDP2 with uneven
    shards (an empty one at 3 ranks), fed the unsharded run's gradients: params and gathered
    states bit for bit those of the unsharded optimizer (distributed Newton-Schulz on owner
    ranks, from the stored rows). Bytes per step: ``benchmarks/muon_comm.py``."""
    W.launch(W.muon_exact_worker, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank1_fsdp_exact_at_1_2_3_ranks(world):
    """AdamW4bit(rank1_normalization=True), and AdamW with state_format={"exp_avg": "8bit",
    "exp_avg_sq": "4bit"}, under FSDP2 (uneven shards, an empty one at 3 ranks): params and
    gathered states (block records, rank-1 codes, row and column maxima) bit for bit those of the
    unsharded optimizer; the column maxima are one all-reduce(MAX) per state and step."""
    W.launch(W.rank1_exact_worker, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_param_correction_fsdp_exact_at_1_2_3_ranks(world):
    """bfloat16 params with an int8 master-weight correction under FSDP2 (uneven shards, an
    empty one at 3 ranks): params, corrections and states bit for bit the unsharded run's."""
    W.launch(W.correction_exact_worker, world)


@pytest.mark.parametrize("world", [2, 3])
def test_rmsprop_adagrad_fsdp_exact(world):
    """RMSprop and Adagrad (low-bit, every state kept: momentum, centered; lr_decay and an initial
    accumulator value) under FSDP2 (uneven shards, an empty one at 3 ranks): params and gathered
    states bit for bit those of one process."""
    W.launch(W.rules_exact_worker, world)


@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 3])
def test_torch_family_fsdp_exact_and_dcp(tmp_path, world):
    """Adamax, Adadelta, RAdam and NAdam in their low-bit formats (fsdp_workers.FAMILY_FORMATS)
    under FSDP2 (uneven shards, an empty one at 3 ranks): params and gathered states bit for bit
    those of one process; a DCP round trip gives the saved states and the same continuation."""
    W.launch(W.family_worker, world, str(tmp_path))


def test_hsdp_exact_for_every_record_kind():
    """HSDP on a 2x2 gloo mesh (replicated over one dim, sharded over the other): block, rank-1
    and low-rank records gather with ``full_tensor()`` to the unsharded optimizer's, bit for bit."""
    W.launch(W.hsdp_exact_worker, 4)


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    """One inductor / AOTAutograd cache directory shared by the launches of a test (the
    children inherit the environment), so a second run meets a warm cache."""
    cache = tmp_path / "inductor_cache"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    return cache


# The checkpoint scenarios share their launches (save at 2 ranks, load at 3 and 1, rerun at 3)
# and so live in one test: under `pytest -n 2` a shared fixture would run once per xdist worker.
def test_checkpoints_reshard_mesh_invariance(tmp_path):
    """Acceptance 2-6, 9, 11, for AdamW 8-bit / 4-bit / 4-bit rank-1 / FP8, AdEMAMix 8-bit, Muon8bit and Muon4bit
    (low-rank momentum). Asserted in the workers:
    - dcp.save / dcp.load at 2 ranks: every state bit-for-bit, 3 more steps with identical losses;
    - the 2-rank checkpoint loaded at 3 and at 1 rank(s): codes and scales bit-for-bit equal
      to the saved (gathered) ones, and training continues (losses close to the 2-rank run);
    - get_optimizer_state_dict(full_state_dict=True, cpu_offload=True): plain CPU tensors on
      rank 0 only; set_optimizer_state_dict(full_state_dict=True) with and without
      broadcast_from_rank0 loads them exactly and training continues identically.
    Asserted here: mesh invariance, the full state dict in a single process."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    W.launch(W.checkpoint_worker, 2, "save", str(workdir))
    W.launch(W.checkpoint_worker, 3, "load", str(workdir))
    W.launch(W.checkpoint_worker, 1, "load", str(workdir))
    check_mesh_invariance(workdir)
    check_full_state_dict_in_a_single_process(workdir)


def check_mesh_invariance(workdir):
    """Acceptance 2, 3: identical global gradients, 3 steps: codes, scales, fp32 states and
    params bit-for-bit equal on 1, 2 and 3 ranks (uneven shards; the (2, 12) weight has an
    empty shard on 3 ranks; a (13, 12) weight is quantized although its shards are below
    min_quant_size, which the workers assert on every rank)."""
    runs = {w: torch.load(workdir / f"mesh_{w}.pt", weights_only=False) for w in (1, 2, 3)}
    for fmt in W.FORMATS:
        for w in (2, 3):
            W.assert_states_equal(runs[w][fmt]["states"], runs[1][fmt]["states"], what=f"{fmt} {w} vs 1 rank")
            for a, b in zip(runs[w][fmt]["params"], runs[1][fmt]["params"]):
                assert torch.equal(a, b)


def check_full_state_dict_in_a_single_process(workdir):
    """Acceptance 6: the full CPU state dict of the 2-rank run loads into a plain
    (unsharded, no process group) optimizer: states equal, training continues."""
    saved = torch.load(workdir / "saved.pt", weights_only=False)
    for fmt in W.FORMATS:
        model = W.make_model(seed=1)
        model.load_state_dict(saved[fmt]["full_msd"])
        opt = W.make_opt(model.parameters(), fmt)
        opt.load_state_dict(W.by_index(saved[fmt]["full_osd"], model))
        W.assert_states_equal(W.full_states(opt), saved[fmt]["saved"], what=f"{fmt} single process")
        losses = [W.global_batch_step(model, opt, step, 0, 1) for step in range(4, 7)]
        torch.testing.assert_close(losses, saved[fmt]["losses"], rtol=1e-5, atol=1e-6)


def test_readme_torchrun_example(tmp_path, inductor_cache):
    """Acceptance 12: the README's example runs under torchrun with 2 CPU ranks (gloo),
    saves a DCP checkpoint, and resumes from it with 1 rank and CPU offload."""
    ckpt = str(tmp_path / "ckpt")

    def torchrun(nproc, *args):
        return W.run_example(nproc, ckpt, *args)[0]

    out = torchrun(2, "--steps", "2")
    assert "step 1 loss" in out and "full (97, 64) dynamic8" in out and "saved" in out, out
    out = torchrun(1, "--steps", "1", "--offload")
    assert "resumed from" in out and "at step 2 (world size 1)" in out and "step 2 loss" in out, out


@pytest.mark.parametrize("fmt", ["4bit", "muon4bitlr"])
def test_full_gather_of_every_state_loads_into_one_process_bit_exact(tmp_path, fmt):
    """torchtune's way to a full checkpoint: walk ``opt.state`` at 2 ranks, ``full_tensor()`` every
    state (AdamW4bit's rank-1 second moments, Muon4bit's low-rank momentum included), save on
    rank 0; loaded into a single-process optimizer the states equal an unsharded run's bit for
    bit, and so does the next step."""
    import bridge  # noqa: F401  (registers QState with torch.load's weights_only allowlist)

    path = str(tmp_path / "full.pt")
    W.launch(W.full_gather_worker, 2, path, fmt)
    saved = torch.load(path, weights_only=True)
    model, ref = W.make_model(), W.make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved["params"]):
            p.copy_(w)
    opt, ref_opt = W.make_opt(model.parameters(), fmt), W.make_opt(ref.parameters(), fmt)
    opt.load_state_dict({"state": saved["state"], "param_groups": saved["param_groups"]})
    for step in range(3):
        W.set_global_grads(ref, step)
        ref_opt.step()
    W.assert_states_equal(W.full_states(opt), W.full_states(ref_opt), exact=True, what=f"{fmt} gathered")
    W.set_global_grads(model, 3)
    W.set_global_grads(ref, 3)
    opt.step()
    ref_opt.step()
    for p, rp in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, rp)
    W.assert_states_equal(W.full_states(opt), W.full_states(ref_opt), exact=True, what=f"{fmt} next step")


@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 3])
def test_soap_fsdp_exact_on_owner_ranks(world):
    """SOAP (fp32), SOAP8bit and SOAP4bit under FSDP2 (uneven shards, an empty one at 3 ranks), 7 steps with
    an eigenbasis refresh every 2: params and ``full_tensor()`` of every state on every rank bit
    for bit those of one process. Offloaded over an NCCL-only
    mesh group (simulated), the step names the fix; with a registered host group its gathers and
    scatters run there."""
    W.launch(W.soap_exact_worker, world)


@pytest.mark.slow
def test_soap_full_tensor_of_every_state_2_ranks():
    """SOAP and SOAP4bit at 2 ranks, 5 steps with eigenbasis refreshes: under FSDP2 and on a 1-D
    mesh (a 1-D param, column shards that cut blocks and that hold whole ones), every state but the
    0-d scalars a DTensor placed as docs/guide/soap.md says, its ``full_tensor()`` bit for bit the
    one-process state."""
    W.launch(W.soap_full_tensor_worker, 2)


@pytest.mark.extended
def test_soap_dcp_save_at_2_resume_at_1_and_3(tmp_path):
    """SOAP and SOAP8bit under FSDP2: ``dcp.save(opt.state_dict())`` at 2 ranks, loaded at 1 and
    3 (each state's blocks and each param's owner change): ``full_tensor()`` of every state bit for
    bit the unsharded run's, and after 3 more steps (a refresh among them) params and states too."""
    W.launch(W.soap_dcp_save_worker, 2, str(tmp_path))
    W.launch(W.soap_dcp_load_worker, 1, str(tmp_path))
    W.launch(W.soap_dcp_load_worker, 3, str(tmp_path))


@pytest.mark.extended
def test_soap_dcp_through_torch_state_dict_helpers(tmp_path):
    """The same through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (what
    torchtitan and accelerate call; keys by param name): saved at 2 ranks, loaded at 3, then 3 more
    steps, bit for bit the unsharded run."""
    W.launch(W.soap_dcp_save_worker, 2, str(tmp_path), 4, True)  # steps, helpers
    W.launch(W.soap_dcp_load_worker, 3, str(tmp_path), 4, 3, True)  # steps, more, helpers
    from bridge.tools.inspect_state import inspect_path

    rows = inspect_path(str(tmp_path / "SOAP8bit")).rows  # `lowbit-tree inspect` of the sharded checkpoint
    factors = [r for r in rows if "eigenbasis_" in r.path or "coupling_" in r.path]
    quantized = [r for r in factors if "codes" in r.detail]  # the others are under min_quant_size: float32
    assert quantized and all(r.format == "dynamic8" and r.block == "64" for r in quantized), quantized
    assert all(r.format == "fp32" for r in factors if r not in quantized)
    assert not [r for r in rows if r.format.startswith("?")]
