#!/usr/bin/env bash
# GKE: the two GPU node pools of the GPU overlays, with the label `specdec/gpu-pool` their pods select and the
# taint they tolerate set as node-pool configuration: nodes the autoscaler adds or re-creates carry them, and the
# autoscaler knows which pool a pending pod needs. Machine types are rows of k8s/README.md, "Node shapes" (the
# requests fit them; the tests check both). GKE adds the taint nvidia.com/gpu=present:NoSchedule to GPU nodes
# itself; the GPU pods tolerate it. Not run by anything here: adapt and run it once.
set -euo pipefail
CLUSTER=${CLUSTER:?the cluster}
LOCATION=${LOCATION:?its region or zone}

gcloud container node-pools create specdec-draft --cluster "$CLUSTER" --location "$LOCATION" \
  --machine-type g2-standard-8 --accelerator type=nvidia-l4,count=1,gpu-driver-version=latest \
  --node-labels specdec/gpu-pool=draft --node-taints specdec/gpu-pool=draft:NoSchedule \
  --enable-autoscaling --min-nodes 2 --max-nodes 16

gcloud container node-pools create specdec-main --cluster "$CLUSTER" --location "$LOCATION" \
  --machine-type g2-standard-48 --accelerator type=nvidia-l4,count=4,gpu-driver-version=latest \
  --node-labels specdec/gpu-pool=main --node-taints specdec/gpu-pool=main:NoSchedule \
  --enable-autoscaling --min-nodes 2 --max-nodes 4
