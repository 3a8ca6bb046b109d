"""Model families, one folder each: the single-device model, its HF adapter, its sharding spec, its shapes.

``mmtrain.model`` holds the Llama-family GPT the trainer runs today; families added here (``deepseek_v3``) are
single-device for now, their parallel wiring pending (docs/model-families.md).
"""
