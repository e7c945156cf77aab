package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// realReplies publishes to a real JetStream and returns its raw replies: a PubAck, a duplicate's
// PubAck, and an API error (the stream holds one message and discards new ones).
func realReplies(t *testing.T, nc *nats.Conn) (ack, dup, apiErr []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "PUBACK", Subjects: []string{"puback.>"}, MaxMsgs: 1, Discard: jetstream.DiscardNew,
		Storage: jetstream.MemoryStorage,
	})
	require.NoError(t, err)
	request := func(id string) []byte {
		m := nats.NewMsg("puback.a")
		m.Header.Set(nats.MsgIdHdr, id)
		m.Data = []byte("x")
		reply, err := nc.RequestMsgWithContext(ctx, m)
		require.NoError(t, err)
		return reply.Data
	}
	return request("one"), request("one"), request("two")
}

// connectNATS starts a JetStream server for the test and connects to it.
func connectNATS(t *testing.T) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(testsvc.StartNATS(t).URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

func TestParsePubAckReadsRealReplies(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	ack, dup, apiErr := realReplies(t, nc)
	t.Logf("replies: %s %s %s", ack, dup, apiErr)

	a, err := parsePubAck(ack)
	require.NoError(t, err)
	require.Equal(t, pubAck{stream: "PUBACK", seq: 1}, a)

	a, err = parsePubAck(dup)
	require.NoError(t, err)
	require.Equal(t, pubAck{stream: "PUBACK", seq: 1, duplicate: true}, a)

	a, err = parsePubAck(apiErr)
	require.NoError(t, err)
	require.NotNil(t, a.apiErr)
	require.Equal(t, 503, a.apiErr.Code)
	require.Equal(t, jetstream.ErrorCode(10077), a.apiErr.ErrorCode, "maximum messages exceeded")
	require.NotEmpty(t, a.apiErr.Description)
}

// The publisher reports a PubAck as success and every other reply as the error that ends the
// session: a JetStream API error (classified by ErrorCode) and "no responders".
func TestPublisherReportsEachKindOfReply(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	realReplies(t, nc) // creates the stream and fills it

	results := make(chan ackResult, 4)
	pub, err := newPublisher(nc, func(a ackResult) { results <- a })
	require.NoError(t, err)
	defer pub.close()
	next := func(t *testing.T) ackResult {
		t.Helper()
		select {
		case a := <-results:
			return a
		case <-time.After(10 * time.Second):
			t.Fatal("no reply")
			return ackResult{}
		}
	}
	publish := func(subj, msgID string, id uint64) {
		m := nats.NewMsg(subj)
		m.Header.Set(nats.MsgIdHdr, msgID)
		require.NoError(t, pub.publish(m, eventToken(id)))
	}

	publish("puback.a", "one", 7)                                  // a duplicate: acknowledged
	require.Equal(t, ackResult{id: 7, seq: 1, dup: true}, next(t)) // the stored copy's sequence

	publish("puback.a", "three", 8) // the stream is full
	a := next(t)
	require.EqualValues(t, 8, a.id)
	var apiErr *jetstream.APIError
	require.ErrorAs(t, a.err, &apiErr)
	require.Equal(t, jetstream.ErrorCode(10077), apiErr.ErrorCode)

	publish("nostream.a", "four", 9) // no stream listens
	a = next(t)
	require.EqualValues(t, 9, a.id)
	require.ErrorIs(t, a.err, errNoResponders)
}

// Late replies are dropped: after close, nothing reaches deliver.
func TestPublisherDropsRepliesAfterClose(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	realReplies(t, nc)

	results := make(chan ackResult, 4)
	pub, err := newPublisher(nc, func(a ackResult) { results <- a })
	require.NoError(t, err)
	inbox := pub.prefix + "1"
	pub.close()
	// Anyone answering on the closed inbox reaches nobody; a flush round trip makes sure the
	// server had the reply before we look.
	require.NoError(t, nc.Publish(inbox, []byte(`{"stream":"PUBACK","seq":1}`)))
	require.NoError(t, nc.Flush())
	select {
	case a := <-results:
		t.Fatalf("reply delivered after close: %+v", a)
	default:
	}
}

func TestReplyError(t *testing.T) {
	status := func(code, descr string) *nats.Msg {
		m := nats.NewMsg("x")
		m.Header.Set(statusHeader, code)
		m.Header.Set(descriptionHeader, descr)
		return m
	}
	body := func(s string) *nats.Msg { return &nats.Msg{Subject: "x", Data: []byte(s)} }

	require.NoError(t, replyError(body(`{"stream":"S","seq":1}`)))
	require.NoError(t, replyError(body(`{"stream":"S","seq":1,"duplicate":true}`)))
	require.ErrorIs(t, replyError(status("503", "")), errNoResponders)
	require.ErrorContains(t, replyError(status("408", "Request Timeout")), "408")
	require.ErrorIs(t, replyError(body(`{"seq":1}`)), errInvalidPubAck, "a PubAck names its stream")
	require.ErrorIs(t, replyError(body(``)), errInvalidPubAck)
	require.ErrorIs(t, replyError(body(`{"stream":"S"`)), errInvalidPubAck)
	var apiErr *jetstream.APIError
	require.ErrorAs(t, replyError(body(`{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}`)), &apiErr)
	require.Equal(t, jetstream.ErrorCode(10077), apiErr.ErrorCode)
}

func TestParsePubAck(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want pubAck
		bad  bool
	}{
		{in: `{"stream":"AGENT_TURNS","seq":42}`, want: pubAck{stream: "AGENT_TURNS", seq: 42}},
		{in: ` { "stream" : "S" , "seq" : 0 , "duplicate" : false , "domain" : "hub" } `, want: pubAck{stream: "S", domain: "hub"}},
		{in: `{"stream":"S","seq":18446744073709551615}`, want: pubAck{stream: "S", seq: 1<<64 - 1}},
		{in: `{"stream":"S","seq":18446744073709551616}`, bad: true},
		{in: `{"stream":"S","seq":-1}`, bad: true},
		{in: `{"stream":"S","seq":1.0}`, bad: true},
		{in: `{"stream":"S","seq":01}`, bad: true},
		{in: `{"stream":"S","seq":null,"domain":null}`, want: pubAck{stream: "S"}},
		{in: `{"stream":"S\u00e9\"","seq":1}`, want: pubAck{stream: "Sé\"", seq: 1}},
		{in: `{"str\u0065am":"S","seq":1}`, want: pubAck{stream: "S", seq: 1}},
		{in: `{"Stream":"S","seq":1}`, want: pubAck{seq: 1}}, // keys match exactly
		{in: `{"stream":"S","val":"1","batch":"b","count":3,"x":[1,{"a":[true,null]},"]"]}`, want: pubAck{stream: "S", batch: "b", count: 3}},
		{in: `{"type":"ack","seq":100,"msgs":50}`, want: pubAck{kind: "ack", seq: 100, msgs: 50}},
		{in: `{"type":"gap","last_seq":9,"seq":11}`, want: pubAck{kind: "gap", seq: 11}},
		{in: `{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}`,
			want: pubAck{apiErr: &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}}},
		{in: `{"error":{"code":-1,"err_code":65536}}`, bad: true},
		{in: `{"error":null}`, want: pubAck{}},
		{in: `{"stream":"S"} x`, bad: true},
		{in: `{"stream":"S",}`, bad: true},
		{in: `{"stream":5}`, bad: true},
		{in: `{"stream":"a` + "\x01" + `"}`, bad: true},
		{in: `{"duplicate":tru}`, bad: true},
		{in: `[]`, bad: true},
		{in: ``, bad: true},
		{in: `{"x":` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `,"stream":"S"}`, want: pubAck{stream: "S"}},
		{in: `{"x":` + strings.Repeat("[{\"a\":", 1000) + "1" + strings.Repeat("}]", 999) + `}`, bad: true},
	} {
		got, err := parsePubAck([]byte(tc.in))
		if tc.bad {
			require.ErrorIs(t, err, errInvalidPubAck, "%s", tc.in)
			continue
		}
		require.NoError(t, err, "%s", tc.in)
		require.Equal(t, tc.want, got, "%s", tc.in)
	}
}

// FuzzParsePubAck checks parsePubAck against encoding/json. Semantics: exact-case keys, last
// duplicate wins, encoding/json's rules for each value. Every input encoding/json accepts as an
// object must give the same fields; inputs it rejects may be rejected or (for unknown keys'
// values only) accepted; no input panics.
func FuzzParsePubAck(f *testing.F) {
	for _, s := range []string{
		`{"stream":"AGENT_TURNS","seq":42}`,
		`{"stream":"AGENT_TURNS","seq":42,"duplicate": true}`, // nats-server 2.15's spacing
		`{"stream":"S","domain":"d","seq":1}`,
		`{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},"stream":"PUBACK","seq":0}`,
		`{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}`,
		`{"error":{"code":400,"err_code":10060,"description":"expected stream does not match"}}`,
		`{"stream":"S\u00e9","seq":1,"x":[1,"a",{"b":null}]}`,
		`{"str\u0065am":"S","seq":-0}`,
		`{}`, `null`, `[]`, `{"seq":1e3}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := parsePubAck(data)
		want, ok := pubAckOracle(data)
		if !ok {
			return
		}
		require.NoError(t, err, "encoding/json accepts %q", data)
		require.Equal(t, want, got, "%q", data)
	})
}

// pubAckOracle decodes data with encoding/json, with parsePubAck's semantics; ok is false when
// encoding/json rejects it.
func pubAckOracle(data []byte) (a pubAck, ok bool) {
	if t := bytes.TrimLeft(data, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return a, false
	}
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil {
		return a, false
	}
	// The map keeps only the last of duplicate keys; encoding/json decoding into a struct checks
	// every occurrence ({"seq":1.0,"seq":1} is an error there and in parsePubAck).
	var typed struct {
		Stream    string
		Seq       uint64
		Duplicate bool
		Domain    string
		Error     *struct {
			Code        int
			ErrCode     uint16 `json:"err_code"`
			Description string
		}
	}
	if json.Unmarshal(data, &typed) != nil {
		return a, false
	}
	field := func(m map[string]json.RawMessage, key string, dst any) bool {
		raw, present := m[key]
		return !present || json.Unmarshal(raw, dst) == nil
	}
	if !field(top, "stream", &a.stream) || !field(top, "seq", &a.seq) || !field(top, "duplicate", &a.duplicate) ||
		!field(top, "domain", &a.domain) {
		return a, false
	}
	if raw, present := top["error"]; present && string(bytes.TrimSpace(raw)) != "null" {
		var e map[string]json.RawMessage
		if json.Unmarshal(raw, &e) != nil {
			return a, false
		}
		a.apiErr = &jetstream.APIError{}
		if !field(e, "code", &a.apiErr.Code) || !field(e, "err_code", &a.apiErr.ErrorCode) ||
			!field(e, "description", &a.apiErr.Description) {
			return a, false
		}
	}
	return a, true
}
