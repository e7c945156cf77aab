package deploytest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// yamlDocs decodes every document of a YAML file into maps, failing on invalid YAML.
func yamlDocs(t *testing.T, file string) []map[string]any {
	t.Helper()
	dec := yaml.NewDecoder(bytes.NewReader(readFile(t, file)))
	var docs []map[string]any
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		require.NoError(t, err, file)
		if doc != nil {
			docs = append(docs, doc)
		}
	}
}

// yamlFiles returns the YAML files under a directory of the module, relative to its root.
func yamlFiles(t *testing.T, dir string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(path(dir), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if ext := filepath.Ext(p); ext == ".yaml" || ext == ".yml" {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			files = append(files, rel)
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, files, "no YAML under %s", dir)
	return files
}

// The Kubernetes objects the tests read, decoded from YAML through JSON tags.
type k8sObject struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   k8sMeta           `json:"metadata"`
	Data       map[string]string `json:"data"`
	StringData map[string]string `json:"stringData"`
	Spec       struct {
		Replicas       *int        `json:"replicas"`
		Selector       k8sSelector `json:"selector"`
		MinAvailable   any         `json:"minAvailable"`
		MaxUnavailable any         `json:"maxUnavailable"`
		Template       struct {
			Metadata k8sMeta `json:"metadata"`
			Spec     struct {
				SecurityContext struct {
					RunAsNonRoot *bool `json:"runAsNonRoot"`
					RunAsUser    *int  `json:"runAsUser"`
					FSGroup      *int  `json:"fsGroup"`
				} `json:"securityContext"`
				Containers []k8sContainer `json:"containers"`
				Volumes    []struct {
					Name   string `json:"name"`
					Secret *struct {
						SecretName string `json:"secretName"`
						Items      []struct {
							Key  string `json:"key"`
							Path string `json:"path"`
						} `json:"items"`
					} `json:"secret"`
				} `json:"volumes"`
			} `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

type k8sMeta struct {
	Name        string            `json:"name"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

type k8sSelector struct {
	MatchLabels map[string]string `json:"matchLabels"`
}

type k8sContainer struct {
	Name    string   `json:"name"`
	Image   string   `json:"image"`
	Command []string `json:"command"`
	Args    []string `json:"args"`
	EnvFrom []struct {
		ConfigMapRef *struct {
			Name string `json:"name"`
		} `json:"configMapRef"`
	} `json:"envFrom"`
	Env []struct {
		Name      string `json:"name"`
		Value     string `json:"value"`
		ValueFrom *struct {
			SecretKeyRef *struct {
				Name string `json:"name"`
				Key  string `json:"key"`
			} `json:"secretKeyRef"`
		} `json:"valueFrom"`
	} `json:"env"`
	Ports []struct {
		Name          string `json:"name"`
		ContainerPort int    `json:"containerPort"`
	} `json:"ports"`
	ReadinessProbe *k8sProbe `json:"readinessProbe"`
	LivenessProbe  *k8sProbe `json:"livenessProbe"`
	VolumeMounts   []struct {
		Name      string `json:"name"`
		MountPath string `json:"mountPath"`
		ReadOnly  bool   `json:"readOnly"`
	} `json:"volumeMounts"`
	Resources struct {
		Limits map[string]string `json:"limits"`
	} `json:"resources"`
}

type k8sProbe struct {
	HTTPGet *struct {
		Path string `json:"path"`
		Port any    `json:"port"`
	} `json:"httpGet"`
}

// kubernetesObjects parses every manifest under deploy/kubernetes, by kind and name.
func kubernetesObjects(t *testing.T) map[string]k8sObject {
	t.Helper()
	objs := map[string]k8sObject{}
	for _, file := range yamlFiles(t, "deploy/kubernetes") {
		for _, doc := range yamlDocs(t, file) {
			b, err := json.Marshal(doc)
			require.NoError(t, err)
			var o k8sObject
			require.NoError(t, json.Unmarshal(b, &o), file)
			if o.Kind == "Kustomization" {
				continue
			}
			require.NotEmpty(t, o.APIVersion, file)
			require.NotEmpty(t, o.Metadata.Name, "%s: a %s without a name", file, o.Kind)
			key := o.Kind + "/" + o.Metadata.Name
			require.NotContains(t, objs, key, "%s defined twice", key)
			objs[key] = o
		}
	}
	return objs
}

func TestKubernetesKustomization(t *testing.T) {
	t.Parallel()
	docs := yamlDocs(t, "deploy/kubernetes/kustomization.yaml")
	require.Len(t, docs, 1)
	resources, ok := docs[0]["resources"].([]any)
	require.True(t, ok)
	listed := map[string]bool{}
	for _, r := range resources {
		name, _ := r.(string)
		_, err := os.Stat(path("deploy", "kubernetes", name))
		require.NoError(t, err, "kustomization lists %s", name)
		listed[name] = true
	}
	// Every manifest is applied, except the optional autoscaler (see kustomization.yaml).
	for _, file := range yamlFiles(t, "deploy/kubernetes") {
		name := filepath.Base(file)
		if name != "kustomization.yaml" && name != "worker-hpa.yaml" {
			require.True(t, listed[name], "kustomization.yaml does not list %s", name)
		}
	}
}

func TestKubernetesManifests(t *testing.T) {
	t.Parallel()
	objs := kubernetesObjects(t)
	relayDep, ok := objs["Deployment/baton-relay"]
	require.True(t, ok)
	workerDep, ok := objs["Deployment/baton-worker"]
	require.True(t, ok)
	job, ok := objs["Job/baton-migrate"]
	require.True(t, ok)

	require.NotNil(t, relayDep.Spec.Replicas)
	require.Equal(t, 2, *relayDep.Spec.Replicas, "two relays: one active, one standby")
	require.Equal(t, []string{"migrate"}, job.Spec.Template.Spec.Containers[0].Args)

	// Pod disruption budgets cover the relay and the workers.
	covered := map[string]bool{}
	for _, o := range objs {
		if o.Kind != "PodDisruptionBudget" {
			continue
		}
		require.True(t, o.Spec.MinAvailable != nil || o.Spec.MaxUnavailable != nil, o.Metadata.Name)
		for _, d := range []k8sObject{relayDep, workerDep} {
			if selects(o.Spec.Selector, d.Spec.Template.Metadata.Labels) {
				covered[d.Metadata.Name] = true
			}
		}
	}
	require.True(t, covered["baton-relay"], "a PodDisruptionBudget for the relay")
	require.True(t, covered["baton-worker"], "a PodDisruptionBudget for the workers")

	secrets := objs["Secret/baton-secrets"]
	for k, v := range secrets.StringData {
		if strings.Contains(k, "database-url") {
			require.Contains(t, v, "CHANGE-ME", "the example Secret holds placeholders only: %s", k)
		}
	}
	config := objs["ConfigMap/baton-config"]

	for _, d := range []k8sObject{relayDep, workerDep, job} {
		name := d.Kind + "/" + d.Metadata.Name
		spec := d.Spec.Template.Spec
		require.True(t, d.Kind == "Job" || selects(d.Spec.Selector, d.Spec.Template.Metadata.Labels),
			"%s: selector must match its pods", name)
		require.NotNil(t, spec.SecurityContext.RunAsNonRoot, name)
		require.True(t, *spec.SecurityContext.RunAsNonRoot, name)
		require.Len(t, spec.Containers, 1, name)
		c := spec.Containers[0]
		require.Empty(t, c.Command, "%s: the image's entrypoint is the program", name)

		env := map[string]string{}
		for _, from := range c.EnvFrom {
			require.NotNil(t, from.ConfigMapRef, name)
			cm, ok := objs["ConfigMap/"+from.ConfigMapRef.Name]
			require.True(t, ok, "%s: no ConfigMap %s", name, from.ConfigMapRef.Name)
			for k, v := range cm.Data {
				env[k] = v
			}
		}
		for _, e := range c.Env {
			env[e.Name] = e.Value
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				ref := e.ValueFrom.SecretKeyRef
				s, ok := objs["Secret/"+ref.Name]
				require.True(t, ok, "%s: no Secret %s", name, ref.Name)
				require.Contains(t, s.StringData, ref.Key, "%s: Secret %s has no key %s", name, ref.Name, ref.Key)
				env[e.Name] = s.StringData[ref.Key]
			}
		}
		prog := progBaton
		switch {
		case strings.Contains(c.Image, "echoagent"):
			prog = progEchoagent
		case strings.Contains(c.Image, "subscriber"):
			prog = progSubscriber
		}
		t.Run(d.Metadata.Name, func(t *testing.T) {
			checkInvocation(t, invocation{
				where:   "deploy/kubernetes " + name,
				program: prog,
				args:    c.Args,
				env:     batonEnv(env),
			})
		})
		if d.Kind == "Job" {
			continue
		}
		// Probes go to the ops listener of BATON_METRICS_ADDR.
		_, port, err := net.SplitHostPort(env["BATON_METRICS_ADDR"])
		require.NoError(t, err, "%s: BATON_METRICS_ADDR", name)
		require.NotNil(t, c.ReadinessProbe, name)
		require.NotNil(t, c.LivenessProbe, name)
		require.Equal(t, "/readyz", c.ReadinessProbe.HTTPGet.Path, name)
		require.Equal(t, "/healthz", c.LivenessProbe.HTTPGet.Path, name)
		for _, p := range []*k8sProbe{c.ReadinessProbe, c.LivenessProbe} {
			require.Equal(t, port, probePort(t, c, p.HTTPGet.Port), "%s: probe port", name)
		}
		require.Equal(t, port, d.Spec.Template.Metadata.Annotations["prometheus.io/port"], "%s: scrape port", name)
	}
	require.NotEmpty(t, config.Data["BATON_SUBJECT_PREFIX"], "relay and workers share the subject prefix")
}

// selects reports whether a selector matches labels.
func selects(sel k8sSelector, labels map[string]string) bool {
	if len(sel.MatchLabels) == 0 {
		return false
	}
	for k, v := range sel.MatchLabels {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// probePort resolves a probe's port (a number or a container port's name) to a number.
func probePort(t *testing.T, c k8sContainer, port any) string {
	t.Helper()
	switch p := port.(type) {
	case float64:
		return strconv.Itoa(int(p))
	case string:
		for _, cp := range c.Ports {
			if cp.Name == p {
				return strconv.Itoa(cp.ContainerPort)
			}
		}
	}
	t.Fatalf("container %s: probe port %v is neither a number nor one of its ports", c.Name, port)
	return ""
}

// metricsRE finds the metrics relay and consumer register, with their type.
var metricsRE = regexp.MustCompile(`prometheus\.(Counter|Gauge|Histogram|Summary)Opts\{\s*Name:\s*"(baton_[a-z0-9_]+)"`)

// batonMetrics returns every metric relay and consumer register, with its type.
func batonMetrics(t *testing.T) map[string]string {
	t.Helper()
	metrics := map[string]string{}
	for _, file := range []string{"relay/metrics.go", "consumer/metrics.go"} {
		for _, m := range metricsRE.FindAllStringSubmatch(string(readFile(t, file)), -1) {
			metrics[m[2]] = m[1]
		}
	}
	require.Contains(t, metrics, "baton_relay_active", "metrics not found: did relay/metrics.go change shape?")
	require.Contains(t, metrics, "baton_worker_turns_total", "metrics not found: did consumer/metrics.go change shape?")
	return metrics
}

var seriesRE = regexp.MustCompile(`\bbaton_[a-z0-9_]+`)

// checkExpr checks that a PromQL expression queries Baton metrics that exist (histograms
// through their _bucket, _sum and _count series) and returns the metrics it uses.
func checkExpr(t *testing.T, metrics map[string]string, where, expr string) []string {
	t.Helper()
	series := seriesRE.FindAllString(expr, -1)
	require.NotEmpty(t, series, "%s: %q queries no Baton metric", where, expr)
	var used []string
	for _, s := range series {
		name := s
		if _, ok := metrics[name]; !ok {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(s, suffix); ok && metrics[base] == "Histogram" {
					name = base
				}
			}
		}
		require.Contains(t, metrics, name, "%s: %q queries %s, which no Baton component exports", where, expr, s)
		if strings.HasSuffix(s, "_bucket") {
			require.Contains(t, expr, "le", "%s: histogram buckets are aggregated by le", where)
		}
		used = append(used, name)
	}
	return used
}

type alertRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func TestPrometheusAlerts(t *testing.T) {
	t.Parallel()
	metrics := batonMetrics(t)
	var rules alertRules
	dec := yaml.NewDecoder(bytes.NewReader(readFile(t, "deploy", "prometheus", "alerts.yml")))
	dec.KnownFields(true) // Prometheus rejects unknown fields too
	require.NoError(t, dec.Decode(&rules))
	require.NotEmpty(t, rules.Groups)
	used := map[string]bool{}
	names := map[string]bool{}
	for _, g := range rules.Groups {
		require.NotEmpty(t, g.Name)
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "group %s: only alerting rules here", g.Name)
			require.False(t, names[r.Alert], "alert %s defined twice", r.Alert)
			names[r.Alert] = true
			for _, m := range checkExpr(t, metrics, "alert "+r.Alert, r.Expr) {
				used[m] = true
			}
			if r.For != "" {
				_, err := time.ParseDuration(r.For)
				require.NoError(t, err, "alert %s: for", r.Alert)
			}
			require.Contains(t, []string{"critical", "warning"}, r.Labels["severity"], "alert %s: severity", r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], "alert %s: summary", r.Alert)
		}
	}
	// What an operator must hear about.
	for _, m := range []string{
		"baton_relay_active",                  // no active relay
		"baton_relay_slot_lag_bytes",          // slot lag, WAL retained
		"baton_relay_slot_lost",               // slot invalidated
		"baton_relay_reconnects_total",        // reconnect storms
		"baton_worker_oldest_pending_seconds", // requests waiting
		"baton_worker_turns_total",            // error rate
	} {
		require.True(t, used[m], "no alert on %s", m)
	}
	require.Contains(t, string(readFile(t, "deploy", "prometheus", "alerts.yml")), "max(baton_relay_active) == 0")
}

func TestPrometheusConfig(t *testing.T) {
	t.Parallel()
	for _, file := range yamlFiles(t, "deploy/prometheus") {
		if filepath.Base(file) == "alerts.yml" {
			continue
		}
		docs := yamlDocs(t, file)
		require.Len(t, docs, 1, file)
		scrapes, ok := docs[0]["scrape_configs"].([]any)
		require.True(t, ok, "%s: scrape_configs", file)
		require.NotEmpty(t, scrapes)
		ruleFiles, _ := docs[0]["rule_files"].([]any)
		require.Contains(t, ruleFiles, "alerts.yml", "%s loads the alert rules", file)
	}
	// The compose configuration scrapes the services compose runs, on their metrics port.
	cfg := string(readFile(t, "deploy", "prometheus", "prometheus.yml"))
	c := loadCompose(t)
	for _, name := range keys(c.Services) {
		s := c.Services[name]
		addr := s.Environment["BATON_METRICS_ADDR"]
		if addr == "" || len(s.Profiles) > 0 {
			continue
		}
		_, port, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		if s.replicas() > 1 {
			require.Regexp(t, `(?s)names: \["`+regexp.QuoteMeta(name)+`"\].*port: `+port, cfg, "prometheus.yml discovers %s", name)
		} else {
			require.Contains(t, cfg, `"`+name+":"+port+`"`, "prometheus.yml scrapes %s", name)
		}
	}
}

// TestOtherYAML parses the remaining YAML under deploy/.
func TestOtherYAML(t *testing.T) {
	t.Parallel()
	for _, file := range yamlFiles(t, "deploy/grafana") {
		require.NotEmpty(t, yamlDocs(t, file), file)
	}
}

type grafanaPanel struct {
	ID      int            `json:"id"`
	Type    string         `json:"type"`
	Title   string         `json:"title"`
	Panels  []grafanaPanel `json:"panels"`
	Targets []struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	} `json:"targets"`
}

func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	metrics := batonMetrics(t)
	raw := readFile(t, "deploy", "grafana", "baton-dashboard.json")
	require.True(t, json.Valid(raw), "baton-dashboard.json is not valid JSON")
	var d struct {
		UID        string         `json:"uid"`
		Title      string         `json:"title"`
		Panels     []grafanaPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name string `json:"name"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(raw, &d))
	var vars []string
	for _, v := range d.Templating.List {
		vars = append(vars, v.Name)
	}
	require.Contains(t, vars, "instance", "the dashboard has no instance variable")
	require.NotEmpty(t, d.UID)
	require.NotEmpty(t, d.Title)
	ids := map[int]bool{}
	used := map[string]bool{}
	var walk func([]grafanaPanel)
	walk = func(panels []grafanaPanel) {
		for _, p := range panels {
			require.False(t, ids[p.ID], "panel id %d used twice", p.ID)
			ids[p.ID] = true
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
			for _, target := range p.Targets {
				// Every series is filtered by the instance variable: one relay or worker at a time.
				require.Equal(t, strings.Count(target.Expr, "baton_"), strings.Count(target.Expr, `instance=~"$instance"`),
					"panel %q: every metric filtered by $instance: %s", p.Title, target.Expr)
				for _, m := range checkExpr(t, metrics, "panel "+p.Title, target.Expr) {
					used[m] = true
				}
			}
		}
	}
	walk(d.Panels)
	for _, m := range keys(metrics) {
		require.True(t, used[m], "the dashboard shows no panel for %s", m)
	}
}

// TestHealthcheckProbe runs the images' probe (deploy/healthcheck) against a real listener.
func TestHealthcheckProbe(t *testing.T) {
	t.Parallel()
	bin := binary(t, progHealthcheck)
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not ready", http.StatusServiceUnavailable)
	})
	mux.HandleFunc("/slow", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	code := func(args ...string) int {
		err := exec.Command(bin, args...).Run()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		require.NoError(t, err)
		return 0
	}
	require.Equal(t, 0, code(srv.URL+"/healthz"))
	require.Equal(t, 1, code(srv.URL+"/readyz"), "503 is unhealthy")
	require.Equal(t, 1, code("-timeout", "200ms", srv.URL+"/slow"), "a hung endpoint is unhealthy")
	require.Equal(t, 2, code(), "usage error")
	srv.Close()
	require.Equal(t, 1, code(srv.URL+"/healthz"), "nothing listening is unhealthy")
}

// Secrets reach the programs as files, never as environment values (which any process of the
// container, a crash dump or kubectl describe may show): no env entry takes a Secret's key, and
// each *_FILE variable names a file of a read-only Secret volume holding a key the Secret has,
// readable by the pod's group. Each container's GOMEMLIMIT is about 90 % of its memory limit,
// so the Go runtime collects harder before the kernel kills it. No image is :latest.
func TestKubernetesSecretsAsFilesAndMemoryLimits(t *testing.T) {
	t.Parallel()
	objs := kubernetesObjects(t)
	secrets := objs["Secret/baton-secrets"]
	for _, name := range []string{"Deployment/baton-relay", "Deployment/baton-worker", "Job/baton-migrate"} {
		d, ok := objs[name]
		require.True(t, ok, name)
		spec := d.Spec.Template.Spec
		c := spec.Containers[0]
		files := map[string]string{} // path in the container -> the Secret's key
		for _, m := range c.VolumeMounts {
			for _, v := range spec.Volumes {
				if v.Name != m.Name || v.Secret == nil {
					continue
				}
				require.True(t, m.ReadOnly, "%s: the secret volume is mounted read-only", name)
				require.Equal(t, "baton-secrets", v.Secret.SecretName, name)
				for _, it := range v.Secret.Items {
					files[m.MountPath+"/"+it.Path] = it.Key
				}
			}
		}
		require.NotNil(t, spec.SecurityContext.FSGroup, "%s: fsGroup lets the non-root user read the secret files", name)
		fileVars := 0
		for _, e := range c.Env {
			require.True(t, e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil,
				"%s: %s takes a Secret as an environment value; mount it and set %s_FILE", name, e.Name, e.Name)
			if strings.HasPrefix(e.Name, "BATON_") && strings.HasSuffix(e.Name, "_FILE") {
				key, ok := files[e.Value]
				require.True(t, ok, "%s: %s=%s is no file of a mounted Secret (%v)", name, e.Name, e.Value, files)
				require.Contains(t, secrets.StringData, key, "%s: the Secret has no key %s", name, key)
				fileVars++
			}
		}
		require.Positive(t, fileVars, "%s reads no secret from a file", name)

		limit := c.Resources.Limits["memory"]
		require.NotEmpty(t, limit, "%s: a memory limit", name)
		var goMemLimit string
		for _, e := range c.Env {
			if e.Name == "GOMEMLIMIT" {
				goMemLimit = e.Value
			}
		}
		require.NotEmpty(t, goMemLimit, "%s: GOMEMLIMIT", name)
		ratio := float64(memBytes(t, goMemLimit)) / float64(memBytes(t, limit))
		require.InDelta(t, 0.9, ratio, 0.05, "%s: GOMEMLIMIT %s against the limit %s", name, goMemLimit, limit)

		require.NotContains(t, c.Image, ":latest", name)
	}
	relay := string(readFile(t, "deploy", "kubernetes", "relay-deployment.yaml"))
	require.NotContains(t, relay, "# --max-in-flight (default", "--max-in-flight counts events; --max-in-flight-bytes bounds memory")
	require.Contains(t, relay, "--max-in-flight-bytes")

	kustomization := string(readFile(t, "deploy", "kubernetes", "kustomization.yaml"))
	tags := regexp.MustCompile(`(?m)^\s*newTag:\s*(\S+)`).FindAllStringSubmatch(kustomization, -1)
	require.NotEmpty(t, tags)
	for _, m := range tags {
		require.Regexp(t, `^v\d+\.\d+\.\d+$`, m[1], "kustomization.yaml: images are a release version, never latest")
	}
	compose := string(readFile(t, "docker-compose.yml"))
	for _, m := range regexp.MustCompile(`(?m)^\s*image:\s*(\S+)`).FindAllStringSubmatch(compose, -1) {
		image := m[1]
		_, tag, ok := strings.Cut(image, ":")
		require.True(t, ok, "docker-compose.yml: %s has no tag", image)
		require.NotEqual(t, "latest", tag, "docker-compose.yml: %s", image)
	}
}

// memBytes reads a Kubernetes memory quantity (Mi, Gi) or a GOMEMLIMIT value (MiB, GiB).
func memBytes(t *testing.T, s string) int64 {
	t.Helper()
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"Gi", 1 << 30}, {"Mi", 1 << 20}} {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			v, err := strconv.ParseInt(n, 10, 64)
			require.NoError(t, err, s)
			return v * u.mult
		}
	}
	t.Fatalf("memory %q: expected Mi, Gi, MiB or GiB", s)
	return 0
}
