package natsconn_test

import (
	"log"
	"os"

	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/natsconn"
)

// A program of its own connects the way Baton's processes do: the URL from BATON_NATS_URL or
// the file BATON_NATS_URL_FILE names, the login and TLS from the BATON_NATS_* paths.
func ExampleSettings_Connect() {
	url, err := natsconn.ValueOrFile(natsconn.EnvURL, os.Getenv(natsconn.EnvURL),
		natsconn.EnvURLFile, os.Getenv(natsconn.EnvURLFile))
	if err != nil {
		log.Fatal(err) // names the variable and the path, never the file's contents
	}
	s := natsconn.Settings{
		URL:   url,
		Creds: os.Getenv(natsconn.EnvCreds),
		NKey:  os.Getenv(natsconn.EnvNKey),
		CA:    os.Getenv(natsconn.EnvCA),
		Cert:  os.Getenv(natsconn.EnvCert),
		Key:   os.Getenv(natsconn.EnvKey),
	}
	nc, err := s.Connect(nats.Name("my-service"), nats.MaxReconnects(-1))
	if err != nil {
		// A refused login: "NATS at nats://host:4222 refused the login (user JWT from
		// BATON_NATS_CREDS /run/secrets/my.creds): nats: authorization violation".
		log.Fatal(err)
	}
	defer nc.Close()
}
