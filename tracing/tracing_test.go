package tracing_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/batonhq/baton/tracing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// otelVars are the variables Setup reads; each test starts with all of them unset.
var otelVars = []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
	"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
	"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"}

// setEnv unsets every variable of otelVars for the test, then sets set.
func setEnv(t *testing.T, set map[string]string) {
	for _, v := range otelVars {
		t.Setenv(v, "")
	}
	for k, v := range set {
		t.Setenv(k, v)
	}
}

// Off by default, and whenever the variables say so: Setup installs nothing.
func TestSetupOff(t *testing.T) {
	for name, env := range map[string]map[string]string{
		"no variables":  {},
		"sdk disabled":  {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
		"exporter none": {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
	} {
		t.Run(name, func(t *testing.T) {
			setEnv(t, env)
			before := otel.GetTracerProvider()
			shutdown, err := tracing.Setup(t.Context())
			require.NoError(t, err)
			require.Equal(t, before, otel.GetTracerProvider(), "nothing installed")
			require.NoError(t, shutdown(t.Context()))
		})
	}
}

// Values Setup cannot honour are a clear error, and install nothing.
func TestSetupRefusesWhatItCannotDo(t *testing.T) {
	for name, env := range map[string]map[string]string{
		"console exporter": {"OTEL_TRACES_EXPORTER": "console"},
		"grpc protocol":    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
	} {
		t.Run(name, func(t *testing.T) {
			setEnv(t, env)
			before := otel.GetTracerProvider()
			_, err := tracing.Setup(t.Context())
			require.ErrorIs(t, err, tracing.ErrConfig)
			require.Equal(t, before, otel.GetTracerProvider())
		})
	}
}

// With an endpoint, spans reach an OTLP/HTTP collector, with the service name.
func TestSetupExportsToTheEndpoint(t *testing.T) {
	setEnv(t, nil)
	got := make(chan *coltracepb.ExportTraceServiceRequest, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		req := &coltracepb.ExportTraceServiceRequest{}
		if err != nil || r.URL.Path != "/v1/traces" || proto.Unmarshal(body, req) != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		got <- req
		resp, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(resp)
	}))
	defer srv.Close()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	t.Setenv("OTEL_SERVICE_NAME", "tracing-test")
	defer otel.SetTracerProvider(noop.NewTracerProvider())

	shutdown, err := tracing.Setup(t.Context())
	require.NoError(t, err)
	_, span := otel.Tracer("test").Start(t.Context(), "hello")
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, shutdown(ctx), "shutdown flushes the span")

	select {
	case req := <-got:
		rs := req.GetResourceSpans()
		require.Len(t, rs, 1)
		var service string
		for _, a := range rs[0].GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				service = a.GetValue().GetStringValue()
			}
		}
		require.Equal(t, "tracing-test", service)
		require.Len(t, rs[0].GetScopeSpans(), 1)
		spans := rs[0].GetScopeSpans()[0].GetSpans()
		require.Len(t, spans, 1)
		require.Equal(t, "hello", spans[0].GetName())
	case <-ctx.Done():
		t.Fatal("no span reached the collector")
	}
}
