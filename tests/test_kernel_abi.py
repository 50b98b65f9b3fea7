"""The kernel boundary has one definition (lowbit_tree/kernels/spec.py) and both sides follow it.

Python fills job rows by spec.py's field names; the C kernel is compiled with a header generated
from spec.py (``native.abi_header``) and writes none of those numbers itself. These tests fail
when the sides drift: a number written into cpu.c by hand, a generated header that does not say
what spec.py says, a job row with a field out of place, a built library of another layout, a
C struct that no longer matches the spec (the build must stop), or a backend that unpacks the
hyperparameter vector by position.
"""
from __future__ import annotations

import ast
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.kernels import StepSpec, native, spec, step_hyperparams
from lowbit_tree.rank1 import rank1_quantize
from lowbit_tree.kernels.spec import (
    DTYPE_IDS, DTYPES, FLAGS, HYPER_NAMES, JOB_HEADER, JOB_ROW, NHYPER, RANK1_BLOCK, RULE_IDS, RULES, STATE_FIELDS,
    STATE_SLOTS, Hyper, flag_bits, job_row_index,
)

KERNELS = Path(native.__file__).parent
NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")


def c_code(text: str) -> str:
    """C source without its comments."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def header_values(header: str) -> dict:
    """``{name: int}`` of every ``#define NAME <int>`` and enum member of a generated header."""
    values = {}
    for name, value in re.findall(r"^#define (\w+) \(?(-?\d+)\)?$", header, flags=re.M):
        values[name] = int(value)
    for body in re.findall(r"enum \{([^}]*)\}", header):
        for name, value in re.findall(r"(\w+) = (-?\d+)", body):
            values[name] = int(value)
    return values


def header_layout(header: str, macro: str) -> list:
    """``[(member, index name)]`` of an X-macro of a generated header, in order."""
    (body,) = re.findall(rf"^#define {macro}\(X\) (.*)$", header, flags=re.M)
    return re.findall(r"X\((\w+), (\w+)\)", body)


def test_cpu_c_writes_none_of_the_boundary_numbers():
    """Every name the generated header defines is defined there only; cpu.c indexes the
    hyperparameter vector and tests flags by name, and refuses to build without the header."""
    text = (KERNELS / "cpu.c").read_text()
    code = c_code(text)
    for name in header_values(native.abi_header()):
        assert not re.search(rf"#\s*define\s+{name}\b", code), f"cpu.c defines {name} itself"
        assert not re.search(rf"\b{name}\s*=[^=]", code), f"cpu.c gives {name} a value itself"
    assert not re.search(r"\benum\s*\{[^}]*\bLBT_", code), "cpu.c declares an enum of boundary ids"
    assert not re.search(r"hyper\s*\[\s*-?\d", code), "cpu.c reads the hyperparameter vector by a literal index"
    assert not re.search(r"flags\)?\s*&\s*\(?\d", code), "cpu.c tests a flag by a literal bit"
    assert not re.search(r"\bst\s*\[\s*\d+\s*\]\s*;", code), "cpu.c sizes the state slots by a literal"
    assert re.search(r"#ifndef LBT_JOB_INT64S\s*#error", code), "cpu.c must refuse to build without the header"


def test_header_round_trips_the_spec():
    """Reading the generated header back gives spec.py's tuples, ids and indices, and nothing
    else."""
    header = native.abi_header()
    values = header_values(header)
    want = {}
    want.update({f"LBT_{rule.upper()}": RULE_IDS[rule] for rule in RULES})
    want.update({f"LBT_{name.upper()}": DTYPE_IDS[dt] for name, dt in DTYPES})
    want.update({f"LBT_{flag.upper()}": flag_bits(**{flag: True}) for flag in FLAGS})
    want["LBT_RANK1"] = RANK1_BLOCK
    want.update({f"LBT_H_{name.upper()}": i for i, name in enumerate(HYPER_NAMES)})
    want["LBT_NHYPER"] = NHYPER
    want.update({f"LBT_JOB_{name.upper()}": job_row_index(name) for name in JOB_HEADER})
    want.update({f"LBT_STATE_{name.upper()}": job_row_index(name, 0) - len(JOB_HEADER) for name in STATE_FIELDS})
    want.update(LBT_JOB_FIELDS=len(JOB_HEADER), LBT_STATE_FIELDS=len(STATE_FIELDS), LBT_STATE_SLOTS=STATE_SLOTS,
                LBT_JOB_INT64S=JOB_ROW)
    assert values == want
    # the spec's tuples, read back from the header alone
    by_value = sorted((v, k) for k, v in values.items() if k.startswith("LBT_H_"))
    assert tuple(k.removeprefix("LBT_H_").lower() for _, k in by_value) == HYPER_NAMES
    assert [v for v, _ in by_value] == list(range(NHYPER))
    for macro, fields, prefix in (("LBT_JOB_LAYOUT", JOB_HEADER, "LBT_JOB_"),
                                  ("LBT_STATE_LAYOUT", STATE_FIELDS, "LBT_STATE_")):
        layout = header_layout(header, macro)
        assert tuple(member for member, _ in layout) == fields
        assert [values[index] for _, index in layout] == list(range(len(fields)))
        assert all(index == prefix + member.upper() for member, index in layout)
    assert JOB_ROW == len(JOB_HEADER) + STATE_SLOTS * len(STATE_FIELDS)
    assert sorted(flag_bits(**{f: True}) for f in FLAGS) == [1 << i for i in range(len(FLAGS))]


def test_job_row_puts_each_field_at_its_spec_index():
    """A job of distinct values: each lands at the index spec.py gives its name, and unused
    state slots are zeros (plain states: no compiler needed)."""
    rows, r = 3, 5
    s = StepSpec("adam", decay=True, lr=True)
    p = torch.zeros(rows, r, dtype=torch.bfloat16)
    g = torch.zeros(rows, r, dtype=torch.float16)
    m, m_new, v = torch.zeros(rows, r), torch.zeros(rows, r), torch.zeros(rows, r, dtype=torch.bfloat16)
    hyper = step_hyperparams(s, lr=1e-3)
    states = (native.NativeState(m, m_new, None, None, None, 0), native.NativeState(v, v, None, None, None, 0))
    row = native.job_row(native.NativeJob(rows, r, p, g, p, s, True, True, 0x1_2345_6789, hyper, states))
    assert len(row) == JOB_ROW
    want = dict(rows=rows, R=r, p=p.data_ptr(), g=g.data_ptr(), out=p.data_ptr(), rule=RULE_IDS["adam"],
                flags=flag_bits(decay=True, lr=True, write_param=True, stochastic=True),
                pdt=DTYPE_IDS[torch.bfloat16], gdt=DTYPE_IDS[torch.float16], hyper=hyper.data_ptr(),
                sr_hash=0x2345_6789, corr=0, pout=0, nstates=2)
    assert set(want) == set(JOB_HEADER)
    assert {name: row[job_row_index(name)] for name in JOB_HEADER} == want
    slots = [dict(zip(STATE_FIELDS, row[job_row_index(STATE_FIELDS[0], i):][: len(STATE_FIELDS)]))
             for i in range(STATE_SLOTS)]
    assert slots[0] == dict(zip(STATE_FIELDS, [m.data_ptr(), m_new.data_ptr(), 0, 0, 0, DTYPE_IDS[torch.float32],
                                               0, 0]))
    assert slots[1]["in"] == slots[1]["out"] == v.data_ptr() and slots[1]["bs"] == DTYPE_IDS[torch.bfloat16]
    assert all(x == 0 for slot in slots[2:] for x in slot.values())


@NATIVE
def test_job_row_of_records_puts_each_field_at_its_spec_index():
    """Quantized and rank-1 states: codes, scales or maxima, format and block size at their
    indices."""
    rows, r = 4, 6
    s = StepSpec("adam")
    q = lt.zeros((rows, r), "8bit", signed=True, block_size=4)
    codes = q.codes.view(torch.uint8)
    r1 = rank1_quantize(torch.arange(rows * r, dtype=torch.float32).reshape(rows, r))
    new_codes, rmax, cmax = torch.zeros_like(r1.codes), torch.zeros(rows), torch.zeros(r)
    states = (native.NativeState(codes, codes, q.scale, q.scale, q.format, 4),
              native.NativeState(r1.codes, new_codes, r1.row_max, r1.col_max, r1.format, RANK1_BLOCK, rmax, cmax))
    row = native.job_row(native.NativeJob(rows, r, None, torch.zeros(rows, r), torch.zeros(rows, r), s, False, False,
                                          0, step_hyperparams(s), states))
    at = {name: [row[job_row_index(name, i)] for i in range(STATE_SLOTS)] for name in STATE_FIELDS}
    assert at["in"][:2] == [codes.data_ptr(), r1.codes.data_ptr()]
    assert at["out"][:2] == [codes.data_ptr(), new_codes.data_ptr()]
    assert at["scale_in"][:2] == [q.scale.data_ptr(), r1.row_max.data_ptr()]
    assert at["scale_out"][:2] == [q.scale.data_ptr(), r1.col_max.data_ptr()]
    assert at["f"] == [native._format_address(q.format), native._format_address(r1.format), 0]
    assert at["bs"] == [4, RANK1_BLOCK, 0]
    assert at["rmax_new"] == [0, rmax.data_ptr(), 0] and at["cmax_new"] == [0, cmax.data_ptr(), 0]
    assert row[job_row_index("p")] == 0 and row[job_row_index("nstates")] == 2


@NATIVE
def test_built_library_has_the_spec_layout():
    """The loaded library reports sizeof and offsetof of every field as spec.py places them."""
    layout = native.abi_layout(native.library())
    assert layout == native.expected_abi_layout()
    assert layout[0] == 8 * JOB_ROW and len(layout) == 3 + len(JOB_HEADER) + len(STATE_FIELDS)


def test_cache_key_includes_the_header():
    """A library built under another spec.py is never loaded: the header is in its name."""
    header = native.abi_header()
    assert native._library_path("cc", ["-O3"], header) == native._library_path("cc", ["-O3"], header)
    drifted = header.replace("#define LBT_H_EPS 6", "#define LBT_H_EPS 7")
    assert drifted != header
    assert native._library_path("cc", ["-O3"], header) != native._library_path("cc", ["-O3"], drifted)


def _header_under(monkeypatch, **changes) -> str:
    """The header a spec.py with ``changes`` (its tuples replaced) would generate."""
    for name, value in changes.items():
        monkeypatch.setattr(spec, name, value)
    monkeypatch.setattr(spec, "JOB_ROW", len(spec.JOB_HEADER) + spec.STATE_SLOTS * len(spec.STATE_FIELDS))
    return native.abi_header.__wrapped__()


def _syntax_check(header: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """cpu.c's front end (its _Static_asserts included) with ``header`` force-included."""
    path = tmp_path / "abi.h"
    path.write_text(header)
    return subprocess.run([native._compiler(), "-std=gnu99", "-fsyntax-only", "-include", str(path),
                           str(KERNELS / "cpu.c")], capture_output=True, text=True)


def _compiler_or_skip() -> str:
    try:
        cc = native._compiler()
    except native.BuildError as e:
        pytest.skip(str(e))
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def test_cpu_c_compiles_with_the_spec_header(tmp_path):
    _compiler_or_skip()
    done = _syntax_check(native.abi_header(), tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("drift", ["swap", "extra-job-field", "missing-state-field", "more-slots", "no-header"])
def test_a_layout_drift_stops_the_build(drift, monkeypatch, tmp_path):
    """cpu.c stops at its layout checks when spec.py and lbt_job disagree: fields in another
    order, a field the struct lacks (what adding a master-weight pointer to spec.py alone would
    do), one the struct has and the spec lacks, another number of state slots; and without the
    header it refuses to build at all."""
    _compiler_or_skip()
    if drift == "swap":
        header = _header_under(monkeypatch, JOB_HEADER=("rows", "R", "g", "p") + JOB_HEADER[4:])
    elif drift == "extra-job-field":
        header = _header_under(monkeypatch, JOB_HEADER=JOB_HEADER + ("master",))
    elif drift == "missing-state-field":
        header = _header_under(monkeypatch, STATE_FIELDS=STATE_FIELDS[:-1])
    elif drift == "more-slots":
        header = _header_under(monkeypatch, STATE_SLOTS=STATE_SLOTS + 1)
    else:
        header = ""
    assert header != native.abi_header()
    done = _syntax_check(header, tmp_path)
    assert done.returncode != 0
    if drift == "no-header":
        assert "-include" in done.stderr
    elif drift == "extra-job-field":
        assert "master" in done.stderr
    else:
        assert "spec" in done.stderr  # a _Static_assert's message


def _unpacks_by_position(path: Path) -> list:
    """Lines of ``path`` that read the hyperparameter vector by position: ``hyper[<int>]``, or a
    tuple unpacked from the vector (``a, b, ... = hyper.unbind(0)``, ``= hyper.tolist()``...)."""
    def is_vector(expr) -> bool:
        return re.match(r"[\w.]*\bhyper\b", ast.unparse(expr)) is not None

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Subscript) and is_vector(node.value)
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
            found.append(node.lineno)
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Tuple) for t in node.targets)
                and is_vector(node.value)):
            found.append(node.lineno)
    return sorted(set(found))


@pytest.mark.parametrize("module", ["torch_backend.py", "native.py", "spec.py", "__init__.py"])
def test_python_reads_the_vector_by_name(module):
    assert _unpacks_by_position(KERNELS / module) == []


def test_the_position_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("b1, omb1 = hyper.unbind(0)[:2]\nlr = job.hyper[7]\nout, new = step(spec, hyper, g)\n")
    assert _unpacks_by_position(bad) == [1, 2]


@pytest.mark.parametrize("rule", RULES)
def test_step_hyperparams_puts_each_value_under_its_name(rule):
    """Every entry of the vector is the value its name says, rounded once from float64, on the
    host path and the tensor path (what GPU tensors take)."""
    import unittest.mock

    s = StepSpec(rule)
    kw = dict(count=4, b1=0.81, b2=0.97, eps=3e-7, lr=0.125, weight_decay=0.0625, l2=0.25, b3=0.995, alpha=6.0,
              cg=0.375, cm=2.5)
    adam = rule in ("adam", "ademamix", "adamax", "nadam")  # the rules with bias-corrected moments
    want = dict(b1=0.81, omb1=1 - 0.81, b2=0.97, omb2=1 - 0.97,
                rbc1=1 / (1 - 0.81 ** 5) if adam else 0.0, rsbc2=1 / math.sqrt(1 - 0.97 ** 5) if adam else 0.0,
                eps=3e-7, lr=0.125, wd=0.0625, l2=0.25, b3=0.995, omb3=1 - 0.995 if rule == "ademamix" else 0.0,
                alpha=6.0, cm=2.5, rect=0.0, cg=0.375)  # cg, cm: nadam's, as given (spec.nadam_terms)
    if rule == "radam":  # step 5 at b2 = 0.97: rho_t = 4.9, not rectified (test_torch_family: both branches)
        want.update(cm=1 / (1 - 0.81 ** 5), rect=0.0)
    assert set(want) == set(HYPER_NAMES)
    host = step_hyperparams(s, **kw)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in kw.items()}
    with unittest.mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        dev = step_hyperparams(s, **tensors)
    for vec in (host, dev):
        assert vec.dtype == torch.float32 and vec.shape == (NHYPER,)
        h = Hyper(*vec.tolist())
        for name in HYPER_NAMES:
            assert getattr(h, name) == np.float32(want[name]), (rule, name)


def test_cpu_c_reads_a_jobs_variant_from_the_header_only():
    """cpu.c tests no variant flag itself: a job's variant (rule_run's VAR) is the header's
    LBT_JOB_VARIANT, generated from the rules' declared variants, so a variant declared in
    rules.py cannot be missed by a hand-written switch in C."""
    code = c_code((KERNELS / "cpu.c").read_text())
    for flag in lt.rules.VARIANT_FLAGS:
        name = f"LBT_{flag.upper()}"
        assert not re.search(rf"\b{name}\b", code), f"cpu.c tests {name} itself: use job_variant (LBT_JOB_VARIANT)"
    assert "LBT_JOB_VARIANT(" in code


def test_job_variant_has_bit_i_for_the_rules_ith_variant(tmp_path):
    """The generated LBT_JOB_VARIANT, compiled, gives each rule and combination of its flags the
    VAR rule_run reads: RMSprop has_momentum 1, centered 2 (cpu.c's rule_run, ``VAR & 2``), Adam
    amsgrad 1, SGD and Muon nesterov 1; a rule's flag set on another rule is no variant of it;
    every other rule is 0."""
    cc = _compiler_or_skip()
    expected = {("adam", ("amsgrad",)): 1, ("momentum", ("nesterov",)): 1, ("muon", ("nesterov",)): 1,
                ("rmsprop", ("has_momentum",)): 1, ("rmsprop", ("centered",)): 2,
                ("rmsprop", ("has_momentum", "centered")): 3, ("adam", ("nesterov",)): 0,
                ("momentum", ("amsgrad", "centered")): 0}
    expected.update({(r, ()): 0 for r in RULES})
    expected.update({(r, tuple(lt.rules.VARIANT_FLAGS)): 0 for r in RULES
                     if not lt.rules.RULE_DEFS[r].variants})
    (tmp_path / "abi.h").write_text(native.abi_header())
    cases = list(expected)
    lines = [f"printf(\"%d\\n\", LBT_JOB_VARIANT(LBT_{r.upper()}, "
             f"{' | '.join(f'LBT_{f.upper()}' for f in flags) or '0'}));" for r, flags in cases]
    (tmp_path / "v.c").write_text('#include <stdio.h>\n#include "abi.h"\nint main(void) {\n'
                                  + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "v"
    done = subprocess.run([cc, "-std=gnu99", str(tmp_path / "v.c"), "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert dict(zip(cases, got)) == expected
    # The Python side's number (the Triton launcher's VAR) is the same definition.
    for (r, flags), var in expected.items():
        own = [f for f in flags if f in lt.rules.RULE_DEFS[r].variants]
        assert StepSpec(r, **{f: True for f in own}).variant == var, (r, flags)


def _instantiated_variants() -> set:
    """``{(rule id name, VAR)}`` that the generated header's LBT_ALL_RULES instantiates (any
    transform, decoding or epilogue)."""
    code = native.abi_header().replace("\\\n", " ")
    (body,) = re.findall(r"#define LBT_ALL_RULES\s+(.*)", code)
    return {(r, int(v)) for r, v in re.findall(r"LBT_RUN\(\s*LBT_(\w+)\s*,\s*(\d+)", body)}


def test_cpu_c_takes_its_instantiations_from_the_header_only():
    """cpu.c expands the generated LBT_ALL_RULES (spec.INSTANCES) and defines no list of its own,
    so the compiled combinations cannot drift from the declaration's rules and variants."""
    code = c_code((KERNELS / "cpu.c").read_text())
    assert not re.search(r"#define\s+LBT_ALL_RULES\b", code), "cpu.c defines LBT_ALL_RULES: spec.INSTANCES makes it"
    assert code.count("LBT_ALL_RULES") >= 2, "cpu.c no longer expands LBT_ALL_RULES"
    header = native.abi_header().replace("\\\n", " ")
    (body,) = re.findall(r"#define LBT_ALL_RULES\s+(.*)", header)
    runs = re.findall(r"LBT_RUN\(LBT_(\w+), (\d+), (\d+), (\d+), (\d+)\)", body)
    assert [(r.lower(), *map(int, rest)) for r, *rest in runs] == spec.instances()


def test_instances_refuse_a_table_that_misses_a_declared_variant(monkeypatch):
    table = dict(spec.INSTANCES, adam=spec.INSTANCES["adam"][:1])  # amsgrad's VAR 1 left out
    monkeypatch.setattr(spec, "INSTANCES", table)
    with pytest.raises(ValueError, match="adam"):
        spec.instances()


def test_every_declared_rule_and_variant_is_instantiated():
    """Each rule of rules.py with each combination of its declared variant flags (VAR
    0 .. 2**n - 1, as LBT_JOB_VARIANT numbers them) has a kernel instantiation in cpu.c, and cpu.c
    instantiates nothing else: a rule or variant declared without its C code fails here, not at a
    step's abort()."""
    declared = {(r.upper(), v) for r, d in lt.rules.RULE_DEFS.items() for v in range(2 ** len(d.variants))}
    found = _instantiated_variants()
    assert len(found) > 10, "the parse of LBT_ALL_RULES found too little"
    assert declared - found == set(), f"declared but not instantiated in cpu.c's LBT_ALL_RULES: {sorted(declared - found)}"
    assert found - declared == set(), f"instantiated but not declared in rules.py: {sorted(found - declared)}"
