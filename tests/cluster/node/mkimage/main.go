// Command mkimage writes a single-layer image as a docker-archive tarball (the format
// `ctr images import` and `docker load` read) from files on disk, with no registry and no
// base image. Every timestamp is fixed, so the same inputs give the same image digest.
//
//	mkimage -name localhost/kube-apiserver-proxy/pause:1 -out pause.tar \
//	        -entrypoint /pause ./pause=/pause
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// epoch is the time stamped on every file and on the image config.
var epoch = time.Unix(0, 0).UTC()

func main() {
	ref := flag.String("name", "", "image name with tag, e.g. localhost/kube-apiserver-proxy/pause:1")
	out := flag.String("out", "", "docker-archive tarball to write")
	entrypoint := flag.String("entrypoint", "", "entrypoint, space-separated words")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: mkimage -name NAME:TAG -out FILE.tar [-entrypoint CMD] SRC=/DEST...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *ref == "" || *out == "" || flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*ref, *out, strings.Fields(*entrypoint), flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(ref, out string, entrypoint, files []string) error {
	tag, err := name.NewTag(ref, name.StrictValidation)
	if err != nil {
		return err
	}
	layerTar, err := buildLayer(files)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.OS = "linux"
	cfg.Architecture = runtime.GOARCH
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint = entrypoint
	cfg.Config.Env = []string{"PATH=/"}
	cfg.Config.WorkingDir = "/"
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if err := tarball.Write(tag, img, f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// buildLayer makes an uncompressed layer tarball holding /tmp (mode 1777) and each
// SRC=/DEST file, executable, owned by root.
func buildLayer(files []string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := &tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: epoch, Format: tar.FormatPAX}
	if err := tw.WriteHeader(dir); err != nil {
		return nil, err
	}
	for _, spec := range files {
		src, dest, ok := strings.Cut(spec, "=")
		if !ok || !strings.HasPrefix(dest, "/") || strings.Count(dest, "/") != 1 {
			return nil, fmt.Errorf("file %q: want SRC=/NAME (a file at the image root)", spec)
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		hdr := &tar.Header{
			Typeflag: tar.TypeReg,
			Name:     strings.TrimPrefix(dest, "/"),
			Mode:     0o755,
			Size:     int64(len(data)),
			ModTime:  epoch,
			Format:   tar.FormatPAX,
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
