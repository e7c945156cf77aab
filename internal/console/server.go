package console

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

//go:embed static
var staticFiles embed.FS

// Server is the console: pages, a JSON API and event streams over one read-only pool, plus
// producer.Send for the chat.
type Server struct {
	cfg     Config
	log     *slog.Logger
	prod    *producer.Producer
	streams atomic.Int64
	mux     *http.ServeMux
	userSum [32]byte
	passSum [32]byte

	mu       sync.Mutex
	watchers map[string]map[chan struct{}]struct{} // conversation id → wake channels
	clients  map[string]int                        // client IP address → its open event streams
}

// New fills cfg's defaults and validates it.
func New(cfg Config) (*Server, error) {
	if cfg.Pool == nil {
		return nil, errors.New("console: Pool is required")
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	switch {
	case cfg.MaxStreamsPerClient < 0:
		return nil, fmt.Errorf("console: MaxStreamsPerClient must be positive (got %d)", cfg.MaxStreamsPerClient)
	case cfg.MaxStreamsPerClient == 0:
		cfg.MaxStreamsPerClient = DefaultMaxStreamsPerClient
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxContentBytes <= 0 {
		cfg.MaxContentBytes = DefaultMaxContentBytes
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	if cfg.StreamReadTimeout <= 0 {
		cfg.StreamReadTimeout = DefaultStreamReadTimeout
	}
	if cfg.MaxStreamAge <= 0 {
		cfg.MaxStreamAge = DefaultMaxStreamAge
	}
	if cfg.SubjectPrefix == "" {
		cfg.SubjectPrefix = wire.DefaultSubjectPrefix
	}
	if cfg.Durable == "" {
		cfg.Durable = statusreport.DefaultDurable
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if (cfg.User == "") != (cfg.Password == "") {
		return nil, errors.New("console: basic auth needs both User and Password")
	}
	prod, err := producer.New(producer.Config{MaxContentBytes: cfg.MaxContentBytes, Schema: cfg.Schema, Logger: cfg.Logger})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	s := &Server{cfg: cfg, log: cfg.Logger, prod: prod, watchers: map[string]map[chan struct{}]struct{}{},
		clients: map[string]int{}}
	s.userSum, s.passSum = sha256.Sum256([]byte(cfg.User)), sha256.Sum256([]byte(cfg.Password))
	s.routes()
	return s, nil
}

func (s *Server) routes() {
	m := http.NewServeMux()
	static, _ := fs.Sub(staticFiles, "static") // the embedded directory exists
	m.HandleFunc("GET /{$}", s.page("chat.html"))
	m.HandleFunc("GET /system", s.page("system.html"))
	m.HandleFunc("GET /messages/{id}", s.page("message.html"))
	m.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	m.HandleFunc("GET /api/conversations", s.bounded(s.handleConversations))
	m.HandleFunc("POST /api/conversations", s.bounded(s.handleCreateConversation))
	m.HandleFunc("GET /api/conversations/{id}/messages", s.bounded(s.handleMessages))
	m.HandleFunc("POST /api/conversations/{id}/messages", s.bounded(s.handleSend))
	m.HandleFunc("GET /api/conversations/{id}/events", s.handleEvents) // bounds each read itself
	m.HandleFunc("GET /api/messages/{id}", s.bounded(s.handleTimeline))
	m.HandleFunc("GET /api/status", s.bounded(s.handleStatus))
	m.HandleFunc("/api/", func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusNotFound, "no such API endpoint or method")
	})
	s.mux = m
}

// errDatabaseTimeout is the cause of a request context that RequestTimeout ended.
var errDatabaseTimeout = errors.New("the database did not answer in time")

// bounded gives h's request a context that ends after RequestTimeout (cause
// errDatabaseTimeout): a database that stops answering without closing the connection (a
// half-open TCP connection, a failover whose old address went away) would otherwise hold the
// request until the client gives up, and the page could not tell a lost send from a slow one.
// pgx turns the deadline into a network deadline, so a frozen connection's read returns.
func (s *Server) bounded(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeoutCause(r.Context(), s.cfg.RequestTimeout, errDatabaseTimeout)
		defer cancel()
		h(w, r.WithContext(ctx))
	}
}

// timedOut reports whether r's context was ended by RequestTimeout (bounded), not by the client
// leaving or the server stopping.
func timedOut(r *http.Request) bool {
	return errors.Is(context.Cause(r.Context()), errDatabaseTimeout)
}

// Handler returns the console's HTTP handler: /healthz answers without auth, everything else
// asks for it when configured.
//
// Two guards keep other sites' pages, open in the operator's browser, out:
//   - a cross-origin request that is not a read (a form posting text/plain needs no CORS
//     preflight) is refused (http.CrossOriginProtection, by Sec-Fetch-Site or Origin), so no
//     page can send a message through the console;
//   - without auth (a loopback address then), a Host header that is not a loopback name is
//     refused: a site whose own name resolves to 127.0.0.1 (DNS rebinding) is same-origin
//     with itself, not with the console, and would otherwise read every conversation. With auth,
//     any name is fine: the browser sends the credentials only to the origin they were given
//     for.
func (s *Server) Handler() http.Handler {
	cross := http.NewCrossOriginProtection()
	cross.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusForbidden, "cross-origin request refused: send from the console's own page")
	}))
	return cross.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			_, _ = io.WriteString(w, "ok\n")
			return
		}
		if s.cfg.User == "" && !loopbackHost(r.Host) {
			writeError(w, http.StatusForbidden, "the console without auth answers only to a loopback host name (localhost, 127.0.0.1, [::1])")
			return
		}
		if s.cfg.User != "" && !s.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Basic realm="baton console", charset="UTF-8"`)
			writeError(w, http.StatusUnauthorized, "authentication required")
			return
		}
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'")
		w.Header().Set("X-Frame-Options", "DENY")
		w.Header().Set("Referrer-Policy", "no-referrer")
		s.mux.ServeHTTP(w, r)
	}))
}

// loopbackHost reports whether a request's Host header names this machine's loopback: a
// loopback IP or localhost, with or without a port.
func loopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	return IsLoopback(host)
}

// authorized compares the basic auth credentials in constant time: the hashes have one length
// whatever was sent, and both compares always run.
func (s *Server) authorized(r *http.Request) bool {
	user, pass, ok := r.BasicAuth()
	if !ok {
		return false
	}
	u, p := sha256.Sum256([]byte(user)), sha256.Sum256([]byte(pass))
	okUser := subtle.ConstantTimeCompare(u[:], s.userSum[:])
	okPass := subtle.ConstantTimeCompare(p[:], s.passSum[:])
	return okUser&okPass == 1
}

func (s *Server) page(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		b, err := staticFiles.ReadFile("static/" + name)
		if err != nil {
			writeError(w, http.StatusInternalServerError, "page missing")
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		_, _ = w.Write(b)
	}
}

// Run wakes watched conversations when their outcome is published, until ctx ends. Without
// NATS it waits for ctx. The subscription is a core NATS one: an outcome is only a hint to read
// Postgres now instead of at the next poll, so one missed (NATS away) delays a state by at most
// PollInterval and loses nothing; it keeps no consumer state on the server.
func (s *Server) Run(ctx context.Context) error {
	if s.cfg.NATS == nil {
		<-ctx.Done()
		return nil
	}
	sub, err := s.cfg.NATS.Subscribe(wire.StreamFilter(s.cfg.SubjectPrefix, wire.KindOutcomes), func(m *nats.Msg) {
		_, conv, err := wire.ParseSubject(s.cfg.SubjectPrefix, m.Subject)
		if err != nil {
			return
		}
		s.wake(conv)
	})
	if err != nil {
		return fmt.Errorf("subscribe to outcomes: %w", err)
	}
	<-ctx.Done()
	if err := sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return fmt.Errorf("unsubscribe from outcomes: %w", err)
	}
	return nil
}

// streamClient is who an event stream counts against for MaxStreamsPerClient: the IP address
// of the connection, without its port (each connection of a browser has its own). Headers
// such as X-Forwarded-For are not read: any client can write them.
func streamClient(r *http.Request) string {
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// takeStream counts a new event stream of client against MaxStreamsPerClient and MaxStreams,
// or returns why it is refused; a taken stream is given back with releaseStream.
func (s *Server) takeStream(client string) (refused string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.clients[client] >= s.cfg.MaxStreamsPerClient {
		return fmt.Sprintf("too many open event streams from this client (at most %d)", s.cfg.MaxStreamsPerClient)
	}
	if n := s.streams.Add(1); n > int64(s.cfg.MaxStreams) {
		s.streams.Add(-1)
		return fmt.Sprintf("too many open event streams (at most %d)", s.cfg.MaxStreams)
	}
	s.clients[client]++
	return ""
}

// releaseStream gives back a stream takeStream counted; a client with none left is forgotten.
func (s *Server) releaseStream(client string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.streams.Add(-1)
	if s.clients[client]--; s.clients[client] <= 0 {
		delete(s.clients, client)
	}
}

// watch registers a wake channel for a conversation; the returned func removes it.
func (s *Server) watch(conv string) (chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	set := s.watchers[conv]
	if set == nil {
		set = map[chan struct{}]struct{}{}
		s.watchers[conv] = set
	}
	set[ch] = struct{}{}
	s.mu.Unlock()
	return ch, func() {
		s.mu.Lock()
		delete(set, ch)
		if len(set) == 0 {
			delete(s.watchers, conv)
		}
		s.mu.Unlock()
	}
}

// wake tells every stream watching conv to read it now. It never blocks.
func (s *Server) wake(conv string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.watchers[conv] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// Serve serves the console on ln, which it closes, until ctx ends; then it ends the event
// streams (their requests' context ends with ctx, and a stream's write blocked on a client that
// stopped reading is cut: handleEvents) and shuts down, waiting up to 5 seconds for requests in
// flight, whose database work RequestTimeout bounds.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	srvCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	srv := &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		BaseContext:       func(net.Listener) context.Context { return srvCtx },
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	opsserver.CloseSpareConnsOnShutdown(srv) // a spare dial would fail a 5-second Shutdown
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("console server: %w", err)
	case <-ctx.Done():
	}
	cancel() // ends the event streams, which Shutdown would wait for
	shutdownCtx, stop := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer stop()
	err := srv.Shutdown(shutdownCtx)
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("console server shutdown: %w", err)
	}
	return nil
}

// apiError is every error the API answers: {"error": "..."}.
type apiError struct {
	Error string `json:"error"`
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, apiError{Error: msg})
}

// dbTimeout logs a request whose database work ran out of time and answers 503 with advice,
// which the page shows with a retry.
func (s *Server) dbTimeout(w http.ResponseWriter, r *http.Request, err error, advice string) {
	s.log.Warn("console request: the database did not answer in time", "method", r.Method, "path", r.URL.Path,
		"timeout", s.cfg.RequestTimeout, "error", err)
	writeError(w, http.StatusServiceUnavailable,
		fmt.Sprintf("the database did not answer within %s; %s", s.cfg.RequestTimeout, advice))
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// internalError logs err and answers a generic 500, or 503 when the request's database work
// ran out of time (bounded): internal text never reaches a client.
func (s *Server) internalError(w http.ResponseWriter, r *http.Request, err error) {
	if timedOut(r) {
		s.dbTimeout(w, r, err, "retry")
		return
	}
	if r.Context().Err() != nil {
		return // the client left or the server stops
	}
	s.log.Error("console request failed", "method", r.Method, "path", r.URL.Path, "error", err)
	writeError(w, http.StatusInternalServerError, internalError)
}

// checkID validates an id from a path or body as the producer would: non-empty, at most
// producer.MaxIDBytes bytes, valid UTF-8 without NUL.
func checkID(what, id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%s is empty", what)
	case len(id) > producer.MaxIDBytes:
		return fmt.Errorf("%s is %d bytes, over the limit of %d", what, len(id), producer.MaxIDBytes)
	case !utf8.ValidString(id):
		return fmt.Errorf("%s is not valid UTF-8", what)
	case strings.IndexByte(id, 0) >= 0:
		return fmt.Errorf("%s contains a NUL byte", what)
	}
	return nil
}

// decodeBody reads a JSON body of at most MaxBodyBytes into v, answering the error itself: 413
// when too large, 400 when not JSON. It reports whether v was filled.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	if r.ContentLength > s.cfg.MaxBodyBytes {
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over the limit of %d bytes", s.cfg.MaxBodyBytes))
		return false
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over the limit of %d bytes", s.cfg.MaxBodyBytes))
			return false
		}
		writeError(w, http.StatusBadRequest, "request body is not the expected JSON object: "+jsonProblem(err))
		return false
	}
	if dec.More() {
		writeError(w, http.StatusBadRequest, "request body holds more than one JSON value")
		return false
	}
	return true
}

// jsonProblem describes a decoding error without echoing the body.
func jsonProblem(err error) string {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		return fmt.Sprintf("syntax error at byte %d", syn.Offset)
	case errors.As(err, &typ):
		return fmt.Sprintf("field %q has the wrong type", typ.Field)
	case errors.Is(err, io.EOF):
		return "empty body"
	case strings.HasPrefix(err.Error(), "json: unknown field"):
		return err.Error()[len("json: "):]
	}
	return "malformed JSON"
}

func (s *Server) handleConversations(w http.ResponseWriter, r *http.Request) {
	list, err := listConversations(r.Context(), s.cfg.Pool)
	if err != nil {
		s.internalError(w, r, err)
		return
	}
	if list == nil {
		list = []Conversation{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"conversations": list})
}

type createConversationRequest struct {
	// ID is the conversation's id; empty makes one.
	ID string `json:"id"`
}

func (s *Server) handleCreateConversation(w http.ResponseWriter, r *http.Request) {
	var req createConversationRequest
	if !s.decodeBody(w, r, &req) {
		return
	}
	if req.ID == "" {
		req.ID = "console-" + randomHex(8)
	}
	if err := checkID("conversation id", req.ID); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	created, err := s.prod.CreateConversation(r.Context(), s.cfg.Pool, req.ID)
	if err != nil {
		if errors.Is(err, producer.ErrInvalidInput) {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		s.internalError(w, r, err)
		return
	}
	code := http.StatusOK
	if created {
		code = http.StatusCreated
	}
	writeJSON(w, code, map[string]any{"id": req.ID, "created": created})
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// conversationFromPath validates the {id} path value and checks that the conversation exists,
// answering the error itself.
func (s *Server) conversationFromPath(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("id")
	if err := checkID("conversation id", id); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return "", false
	}
	ok, err := conversationExists(r.Context(), s.cfg.Pool, id)
	if err != nil {
		s.internalError(w, r, err)
		return "", false
	}
	if !ok {
		writeError(w, http.StatusNotFound, "conversation not found")
		return "", false
	}
	return id, true
}

func (s *Server) handleMessages(w http.ResponseWriter, r *http.Request) {
	id, ok := s.conversationFromPath(w, r)
	if !ok {
		return
	}
	rows, err := conversationMessages(r.Context(), s.cfg.Pool, id)
	if err != nil {
		s.internalError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"conversation_id": id, "messages": views(rows)})
}

type sendRequest struct {
	// ID is the client message id, made once in the browser and reused by every retry.
	ID      string `json:"id"`
	Content string `json:"content"`
}

type sendResponse struct {
	ID              string      `json:"id"`
	OutboxID        int64       `json:"outbox_id"`
	AlreadyAccepted bool        `json:"already_accepted"`
	Message         MessageView `json:"message"`
}

// handleSend sends one message with producer.Send, the console's only write. A retry with the
// same id and content is answered like the first send (already_accepted true).
func (s *Server) handleSend(w http.ResponseWriter, r *http.Request) {
	conv := r.PathValue("id")
	if err := checkID("conversation id", conv); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var req sendRequest
	if !s.decodeBody(w, r, &req) {
		return
	}
	res, err := s.prod.Send(r.Context(), s.cfg.Pool, producer.Message{ConversationID: conv, ID: req.ID, Content: req.Content})
	var inputErr *producer.InputError
	switch {
	case errors.As(err, &inputErr) && errors.Is(err, producer.ErrContentTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, "invalid message: content "+inputErr.Reason)
		return
	case errors.As(err, &inputErr):
		writeError(w, http.StatusBadRequest, "invalid message: "+fieldName(inputErr.Field)+" "+inputErr.Reason)
		return
	case errors.Is(err, producer.ErrConversationNotFound):
		writeError(w, http.StatusNotFound, "conversation not found")
		return
	case errors.Is(err, producer.ErrConflict):
		writeError(w, http.StatusConflict, "message id already used by a different message")
		return
	case err != nil && timedOut(r):
		// Whether the message committed is unknown; sending it again with the same id is
		// answered like the first send, never stored twice.
		s.dbTimeout(w, r, err, "retry (the same id is safe)")
		return
	case err != nil:
		s.internalError(w, r, err)
		return
	}
	s.wake(conv)
	resp := sendResponse{ID: req.ID, OutboxID: res.OutboxID, AlreadyAccepted: res.AlreadyAccepted}
	// The current state, so the page need not wait for the stream; reading it may fail without
	// failing the send, which committed.
	if row, err := readMessageRow(r.Context(), s.cfg.Pool, req.ID); err == nil {
		resp.Message = row.view()
	} else {
		resp.Message = MessageView{ID: req.ID, ConversationID: conv, Content: req.Content, State: StateQueued}
	}
	writeJSON(w, http.StatusOK, resp)
}

func fieldName(f string) string {
	switch f {
	case "ID":
		return "id"
	case "ConversationID":
		return "conversation id"
	case "Content":
		return "content"
	}
	return f
}

func (s *Server) handleTimeline(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := checkID("message id", id); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	tl, err := readTimeline(r.Context(), s.cfg.Pool, id)
	switch {
	case errors.Is(err, errNotFound):
		writeError(w, http.StatusNotFound, "message not found")
		return
	case err != nil:
		s.internalError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, tl)
}

// ListenAndServe listens on addr, calls listening with the console's URL, and serves (Serve)
// and follows the outcomes (Run) until ctx ends or one of them fails.
func (s *Server) ListenAndServe(ctx context.Context, addr string, listening func(url string)) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("console listener: %w", err)
	}
	if listening != nil {
		listening("http://" + ln.Addr().String() + "/")
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.Serve(gctx, ln) })
	g.Go(func() error { return s.Run(gctx) })
	return g.Wait()
}
