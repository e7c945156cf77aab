// Package tracing turns on OpenTelemetry trace export from the standard OTEL_* environment
// variables, for Baton's programs and for applications that want the same behaviour. Off by
// default: with none of the variables below set, Setup installs nothing and every span Baton
// makes is the no-op tracer's, which costs next to nothing.
//
// Setup exports over OTLP/HTTP (protobuf) when any of these is set:
//
//	OTEL_EXPORTER_OTLP_ENDPOINT         base URL of a collector, e.g. http://localhost:4318
//	                                    (traces go to <base>/v1/traces)
//	OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  full URL for traces, e.g. http://localhost:4318/v1/traces
//	OTEL_TRACES_EXPORTER=otlp           export to the default, http://localhost:4318
//
// and honours OTEL_SDK_DISABLED=true (nothing is installed), OTEL_TRACES_EXPORTER=none (idem),
// OTEL_SERVICE_NAME (default: the program's name), OTEL_RESOURCE_ATTRIBUTES,
// OTEL_EXPORTER_OTLP_HEADERS / _TRACES_HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE,
// OTEL_TRACES_SAMPLER / _ARG and OTEL_BSP_*, as the OpenTelemetry SDK reads them. The protocol
// (OTEL_EXPORTER_OTLP_PROTOCOL / _TRACES_PROTOCOL) must be http/protobuf, its default; other
// values are an error, as are exporters other than otlp and none.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// ErrConfig is wrapped by Setup's errors about the variables' values.
var ErrConfig = errors.New("tracing configuration")

// Setup installs, when the OTEL_* variables ask for it (see the package documentation), a
// tracer provider exporting over OTLP/HTTP as OpenTelemetry's global one, and the W3C trace
// context and baggage propagators as the global propagator. It returns the function that
// flushes and stops the exporter: call it before the program exits, with a context bounding
// how long it may take. When nothing is asked for, Setup installs nothing and shutdown does
// nothing. ctx bounds the exporter's creation only.
func Setup(ctx context.Context) (shutdown func(context.Context) error, err error) {
	off := func(context.Context) error { return nil }
	on, err := enabled(os.Getenv)
	if err != nil || !on {
		return off, err
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return off, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", programName())),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override
		resource.WithTelemetrySDK())
	if err != nil && res == nil {
		_ = exp.Shutdown(ctx)
		return off, fmt.Errorf("tracing resource: %w", err)
	}
	// A partial resource (a malformed OTEL_RESOURCE_ATTRIBUTES entry) is still used.
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp.Shutdown, nil
}

// enabled decides from the variables (read with getenv) whether to export traces.
func enabled(getenv func(string) string) (bool, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return false, nil
	}
	on := getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
	switch exporter := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exporter {
	case "":
	case "none":
		return false, nil
	case "otlp":
		on = true
	default:
		return false, fmt.Errorf("%w: OTEL_TRACES_EXPORTER=%q: only otlp and none are supported", ErrConfig, exporter)
	}
	if !on {
		return false, nil
	}
	protocol := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if p := strings.TrimSpace(protocol); p != "" && p != "http/protobuf" {
		return false, fmt.Errorf("%w: OTLP protocol %q: only http/protobuf is supported", ErrConfig, p)
	}
	return true, nil
}

// programName is the default service name: the running program's file name.
func programName() string {
	if len(os.Args) == 0 || os.Args[0] == "" {
		return "baton"
	}
	return strings.TrimSuffix(filepath.Base(os.Args[0]), ".exe")
}

// FlushTimeout bounds how long Stop waits for the exporter to send the spans it holds.
const FlushTimeout = 5 * time.Second

// Stop calls shutdown (Setup's) to flush and stop the exporter, within FlushTimeout even when ctx
// is cancelled already (a program stopping on a signal still sends its last spans), and logs a
// failure on log. Programs defer it right after Setup.
func Stop(ctx context.Context, shutdown func(context.Context) error, log *slog.Logger) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), FlushTimeout)
	defer cancel()
	if err := shutdown(sctx); err != nil {
		log.Warn("flush traces", "error", err)
	}
}
