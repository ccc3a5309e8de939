package kafka_test

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
)

// TestBrokerListPasswordNeverPrinted: a broker list whose entries carry userinfo (with a
// scheme, without, with a bad port) is refused without printing the password.
func TestBrokerListPasswordNeverPrinted(t *testing.T) {
	for _, list := range []string{
		"user:secret@k1:badport",
		"kafka://user:secret@k1:9092,k2:9092",
		"k1:9092, user:secret@k2:badport",
		"https://user:secret@k1:9092",
	} {
		_, err := kafka.ParseBrokers(list)
		if err == nil {
			t.Fatalf("ParseBrokers(%q) accepted userinfo", list)
		}
		if strings.Contains(err.Error(), "secret") {
			t.Fatalf("password printed: %v", err)
		}
	}
}
