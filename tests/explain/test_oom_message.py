"""OOM messages copied verbatim from real upstream issues parse to the figures they print.

Each expected figure is the printed number times its unit (PyTorch's ``format_size`` prints binary units with two
decimals: c10/cuda/CUDACachingAllocator.cpp), written out by hand below; reserved is allocated plus the
reserved-but-unallocated figure in the wordings that print that one.
"""

from __future__ import annotations

import pytest

from vramledger.explain.oom_message import find_messages, parse_message
from vramledger.explain.postmortem import Diagnosis, Evidence, PostMortem, diagnose

KiB, MiB, GiB = 2**10, 2**20, 2**30


def b(x: float, unit: int) -> int:
    return round(x * unit)


CASES = [
    pytest.param(
        # pytorch/pytorch#13751 (the PR that introduced this wording, torch 1.0): "cached" = reserved - allocated
        "RuntimeError: CUDA out of memory. Tried to allocate 16.00 GiB (GPU 0; 11.93 GiB total capacity; 4.00 GiB "
        "already allocated; 7.33 GiB free; 179.00 KiB cached)",
        dict(
            requested_bytes=b(16, GiB),
            device=0,
            capacity_bytes=b(11.93, GiB),
            free_bytes=b(7.33, GiB),
            allocated_bytes=b(4, GiB),
            reserved_bytes=b(4, GiB) + b(179, KiB),
            process_bytes=None,
            wording="torch 1.0-1.3",
        ),
        Diagnosis.REQUEST_EXCEEDS_GPU,
        id="torch1.0-cached-pytorch#13751",
    ),
    pytest.param(
        # cherubicXN/afm_cvpr2019#8
        "RuntimeError: CUDA out of memory. Tried to allocate 25.00 MiB (GPU 0; 3.94 GiB total capacity; 3.14 GiB "
        "already allocated; 21.56 MiB free; 634.00 KiB cached)",
        dict(
            requested_bytes=b(25, MiB),
            capacity_bytes=b(3.94, GiB),
            free_bytes=b(21.56, MiB),
            allocated_bytes=b(3.14, GiB),
            reserved_bytes=b(3.14, GiB) + b(634, KiB),
            wording="torch 1.0-1.3",
        ),
        Diagnosis.CAPACITY,
        id="torch1.x-cached-afm_cvpr2019#8",
    ),
    pytest.param(
        # pytorch/pytorch#59778 (torch 1.4-1.9: reserved in total, no hint yet); 3.03 GiB free on the device for a
        # 2.26 GiB request, and the user asks why it failed: the driver refused memory it called free
        "CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total capacity; 781.59 MiB already "
        "allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)",
        dict(
            requested_bytes=b(2.26, GiB),
            capacity_bytes=b(6, GiB),
            free_bytes=b(3.03, GiB),
            allocated_bytes=b(781.59, MiB),
            reserved_bytes=b(1.24, GiB),
            wording="torch 1.4-2.0",
        ),
        Diagnosis.DRIVER_REFUSED,
        id="torch1.4-reserved-pytorch#59778",
    ),
    pytest.param(
        # haotian-liu/LLaVA#1152 (LoRA fine-tuning, torch 1.10-2.0 with the max_split_size_mb hint)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 284.00 MiB (GPU 0; 31.75 GiB total "
        "capacity; 27.12 GiB already allocated; 99.50 MiB free; 30.44 GiB reserved in total by PyTorch) If reserved "
        "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for "
        "Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        dict(
            requested_bytes=b(284, MiB),
            capacity_bytes=b(31.75, GiB),
            free_bytes=b(99.5, MiB),
            allocated_bytes=b(27.12, GiB),
            reserved_bytes=b(30.44, GiB),
            wording="torch 1.4-2.0",
        ),
        Diagnosis.FRAGMENTATION,
        id="torch2.0-hint-LLaVA#1152",
    ),
    pytest.param(
        # kerrj/lerf#73 (torch 2.1: "capacty", NVML process line)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacty of "
        "23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, this process has 20.81 GiB memory in "
        "use. Of the allocated memory 12.09 GiB is allocated by PyTorch, and 4.84 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        dict(
            requested_bytes=b(3, GiB),
            capacity_bytes=b(23.65, GiB),
            free_bytes=b(1.66, GiB),
            process_bytes=b(20.81, GiB),
            allocated_bytes=b(12.09, GiB),
            reserved_bytes=b(12.09, GiB) + b(4.84, GiB),
            wording="torch 2.1",
        ),
        Diagnosis.FRAGMENTATION,
        id="torch2.1-capacty-lerf#73",
    ),
    pytest.param(
        # vllm-project/vllm#2140 (torch 2.1.2: one process's line, no "this process" line). The line is this process
        # as NVML numbers it (a container's pid namespace): 21.65 GiB beside the 21.32 GiB PyTorch reserves, with
        # 4 MiB of 21.67 GiB free, cannot be another process; so the step did not fit (own_process_line)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 518.00 MiB. GPU 0 has a total capacty "
        "of 21.67 GiB of which 4.06 MiB is free. Process 2417585 has 21.65 GiB memory in use. Of the allocated "
        "memory 21.32 GiB is allocated by PyTorch, and 1018.00 KiB is reserved by PyTorch but unallocated. If "
        "reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
        "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        dict(
            requested_bytes=b(518, MiB),
            capacity_bytes=b(21.67, GiB),
            free_bytes=b(4.06, MiB),
            process_bytes=None,
            other_processes=((2417585, b(21.65, GiB)),),
            allocated_bytes=b(21.32, GiB),
            reserved_bytes=b(21.32, GiB) + b(1018, KiB),
            wording="torch 2.1",
        ),
        Diagnosis.CAPACITY,
        id="torch2.1-own-process-line-vllm#2140",
    ),
    pytest.param(
        # pytorch/pytorch#16417, comment of 2024-03-13 (torch >= 2.2: expandable_segments hint)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a total capacity "
        "of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this process has 23.60 GiB memory "
        "in use. Of the allocated memory 22.90 GiB is allocated by PyTorch, and 194.87 MiB is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        dict(
            requested_bytes=b(22, MiB),
            capacity_bytes=b(23.65, GiB),
            free_bytes=b(11.06, MiB),
            process_bytes=b(23.6, GiB),
            allocated_bytes=b(22.9, GiB),
            reserved_bytes=b(22.9, GiB) + b(194.87, MiB),
            wording="torch >= 2.2",
        ),
        Diagnosis.FRAGMENTATION,
        id="torch2.2-expandable-pytorch#16417",
    ),
    pytest.param(
        # bmaltais/kohya_ss#2217 (no NVML line: "0 bytes is free" must read as 0, not as missing)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a total capacity "
        "of 11.00 GiB of which 0 bytes is free. Of the allocated memory 16.98 GiB is allocated by PyTorch, and "
        "696.75 MiB is reserved by PyTorch but unallocated.",
        dict(
            requested_bytes=b(30, MiB),
            capacity_bytes=b(11, GiB),
            free_bytes=0,
            process_bytes=None,
            allocated_bytes=b(16.98, GiB),
            reserved_bytes=b(16.98, GiB) + b(696.75, MiB),
            wording="torch >= 2.2",
        ),
        Diagnosis.FRAGMENTATION,
        id="torch2.2-zero-free-kohya_ss#2217",
    ),
    pytest.param(
        # Built from the format string of the stored pytorch/pytorch commit 001074d (malloc): the allowed_info
        # ("L allowed; ") of set_per_process_memory_fraction and the private-pool clause of CUDA Graphs.
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 60.00 GiB "
        "is free. Including non-PyTorch memory, this process has 19.00 GiB memory in use. 16.00 GiB allowed; Of the "
        "allocated memory 15.50 GiB is allocated by PyTorch, with 1.00 GiB allocated in private pools (e.g., CUDA "
        "Graphs), and 100.00 MiB is reserved by PyTorch but unallocated.",
        dict(
            requested_bytes=b(2, GiB),
            capacity_bytes=b(79.19, GiB),
            allowed_bytes=b(16, GiB),
            private_pool_bytes=b(1, GiB),
            allocated_bytes=b(15.5, GiB),
            reserved_bytes=b(15.5, GiB) + b(100, MiB),
        ),
        Diagnosis.MEMORY_FRACTION_CAP,
        id="format-string-allowed-private-pools",
    ),
]


@pytest.mark.parametrize("text,expected,diagnosis", CASES)
def test_figures_and_cause(text: str, expected: dict[str, object], diagnosis: Diagnosis) -> None:
    msg = parse_message(text)
    assert msg is not None
    got = {k: getattr(msg, k) for k in expected}
    print("expected", expected, "\ngot     ", got, "\nmatch", got == expected)
    assert got == expected
    assert diagnose(Evidence(source="test", message=msg)).diagnosis is diagnosis


def test_a_message_wrapped_over_lines_in_a_log_reads_the_same() -> None:
    one = CASES[4].values[0]
    wrapped = "step 10\nTraceback (most recent call last):\n  ...\n" + one.replace(". ", ".\n    ", 3) + "\n"
    assert parse_message(wrapped) == parse_message(one)


def test_the_last_of_several_messages_counts() -> None:
    log = f"{CASES[2].values[0]}\nretrying with a smaller batch\n{CASES[3].values[0]}\n"
    assert len(find_messages(log)) == 2
    msg = parse_message(log)
    assert msg is not None and msg.requested_bytes == b(284, MiB)


def test_a_message_cut_short_keeps_what_it_has() -> None:
    msg = parse_message("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 23.53 GiB")
    assert msg is not None
    assert (msg.requested_bytes, msg.capacity_bytes, msg.allocated_bytes) == (b(1.96, GiB), b(23.53, GiB), None)


def test_text_without_an_oom_message() -> None:
    assert parse_message("RuntimeError: CUDA error: device-side assert triggered") is None


def _diagnosed(text: str) -> PostMortem:
    msg = parse_message(text)
    assert msg is not None
    return diagnose(Evidence(source="test", message=msg))


def test_a_process_line_that_must_be_this_process_is_taken_for_it() -> None:
    """vllm-project/vllm#2140: the only process line holds more than the device's used memory less PyTorch's own
    reserve, so it is this process (its pid is the host's), not another one holding the GPU."""
    text = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 518.00 MiB. GPU 0 has a total capacty "
        "of 21.67 GiB of which 4.06 MiB is free. Process 2417585 has 21.65 GiB memory in use. Of the allocated "
        "memory 21.32 GiB is allocated by PyTorch, and 1018.00 KiB is reserved by PyTorch but unallocated."
    )
    pm = _diagnosed(text)
    assert (pm.own_pid_inferred, pm.process_bytes, pm.other_processes_bytes) == (2417585, b(21.65, GiB), None)
    assert pm.diagnosis is Diagnosis.CAPACITY


def test_another_process_beside_this_one_still_holds_the_memory() -> None:
    """Built from the format string (torch >= 2.2), two servers on one 23.52 GiB card as in a log where a second
    copy of a job was started: the 1.75 GiB line holds this process's 1.29 GiB reserve, and the 21.48 GiB one is
    another process, which leaves 212.69 MiB free for the 256 MiB asked."""
    text = (
        "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 23.52 GiB of which 212.69 "
        "MiB is free. Process 224599 has 21.48 GiB memory in use. Process 277412 has 1.75 GiB memory in use. Of the "
        "allocated memory 1.15 GiB is allocated by PyTorch, and 143.83 MiB is reserved by PyTorch but unallocated."
    )
    pm = _diagnosed(text)
    assert (pm.own_pid_inferred, pm.other_processes_bytes) == (277412, b(21.48, GiB))
    assert pm.diagnosis is Diagnosis.OTHER_PROCESSES


def test_lines_that_fit_beside_the_reserve_are_left_as_other_processes() -> None:
    """A process line that, with this process's reserve, fits the used memory may be another process: nothing is
    inferred (a card shared with a 458 MiB process, the message's own line for this one cut off)."""
    text = (
        "CUDA out of memory. Tried to allocate 876.00 MiB. GPU 0 has a total capacity of 23.68 GiB of which 251.06 "
        "MiB is free. Process 2612630 has 458.00 MiB memory in use. Of the allocated memory 22.65 GiB is allocated by "
        "PyTorch, and 77.68 MiB is reserved by PyTorch but unallocated."
    )
    pm = _diagnosed(text)
    assert (pm.own_pid_inferred, pm.other_processes_bytes) == (None, b(458, MiB))
