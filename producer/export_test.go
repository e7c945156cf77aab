package producer

// TraceContextForTest is traceContext, for the allocation test.
var TraceContextForTest = traceContext
