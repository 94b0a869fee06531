"""InferX quantization schemes. None is implemented yet: FP8, W4A16 and MXFP4 arrive here; the
unquantized default ("none") lives in inferx-core."""
