"""flashmodel operator: reconciles FlashModel objects into warm, healthy vLLM workloads."""

GROUP = "serving.flashmodel.io"
VERSION = "v1alpha1"
PLURAL = "flashmodels"
KIND = "FlashModel"
FIELD_MANAGER = "flashmodel-operator"
