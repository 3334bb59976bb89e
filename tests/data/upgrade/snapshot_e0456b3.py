"""Half-train a run under the previous release's operator (this tree: e0456b3) and write what a cluster holds."""
import json, sys
from tests.kube import Cluster

out = sys.argv[1]
with Cluster() as c, c.operator(interval=0.5) as op:
    c.op = op
    c.new_run("up", failurePolicy={"maxRestarts": 3, "backoffSeconds": 0})
    c.run_all("up", 0)
    c.set_pod("up-trainer-1-a0", "Failed", exit_code=1)
    c.run_all("up", 1)
    op.settle("up")
    op.stop()
    # half-trained: the progress the previous operator copied from the store (its status shape)
    c.patch(c.tr_path("up") + "/status", {"status": {"step": 40, "samplesConsumed": 1280, "rollout": 5,
                                                      "lastGlobalBatchSize": 32}})
    objs = {"trainingrun": c.run("up")}
    for kind, path in (("configmaps", "/api/v1/namespaces/default/configmaps"),
                       ("services", "/api/v1/namespaces/default/services"),
                       ("pods", "/api/v1/namespaces/default/pods")):
        objs[kind] = c.items(path, "trainingrun.dev/run=up")
    json.dump(objs, open(out, "w"), indent=1, sort_keys=True)
