"""The Kubernetes example is wired to what paxlite reads: its env makes pod i process i of the job."""

import os
import pathlib
import re

from paxlite.parallel.distributed import detect_launch

MANIFEST = os.path.join(os.path.dirname(__file__), "..", "..", "k8s", "indexed-job.yaml")


def test_indexed_job_env_gives_each_pod_its_process_index():
    text = pathlib.Path(MANIFEST).read_text()
    env = dict(re.findall(r"\{name: (PAXLITE_\w+), value: \"([^\"]+)\"\}", text))
    completions = int(re.search(r"completions: (\d+)", text).group(1))
    assert int(env["PAXLITE_NUM_PROCESSES"]) == completions
    dcn = [int(x) for x in re.search(r"DCN_MESH_SHAPE=\[([\d,]+)\]", text).group(1).split(",")]
    assert dcn[0] * dcn[1] * dcn[2] == completions  # one process per node: DCN covers the pods
    for index in range(completions):
        launch = detect_launch(multiprocess_gpu=False, server_addr=None, num_hosts=None, host_idx=None,
                               env={**env, "JOB_COMPLETION_INDEX": str(index)})
        assert (launch.num_processes, launch.process_id) == (completions, index)
        assert launch.coordinator_address == "paxlite-train-0.paxlite-train:12345"
