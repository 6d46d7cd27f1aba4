"""The live stack as a client sees it: streams, overload, the Batch API, in front of SGLang."""
